"""Replicate a module onto devices, once, and keep the replicas in step with it.

``torch.nn.parallel.replicate`` rebuilds every replica on every forward: one Python object per
submodule per device, a ``__dict__`` copy each, and a broadcast of every parameter even when
nothing changed. Here the replica objects (``_replicas.Replicas``) are built
once per (module, devices) and kept. Each call then costs what can have changed, and the check
looks only at the module's own tree (``_check.Snapshot``):

- nothing written since the last call: only the tensors are synced, parameter copies on other
  devices and private buffer copies;
- some module written (an attribute, a training flag, a hook, ``_parameters[k] = p``): the
  replicas of the modules written have their ``__dict__`` refilled;
- the structure changed (a submodule, parameter or buffer added, replaced or moved): the
  replicas are built again.

Nothing here changes torch or any other module. A replica is a module in its own right inside
forward: ``self.parameters()``, ``named_*()``, ``buffers()`` and ``state_dict()`` list that
replica's tensors (torch's replicas list no parameters), and methods, hooks, partials and
closures bound to a module of the tree are bound to the replica (``_rebind``). Replicas never
register the module as a child, so they never appear in ``module.state_dict()``.

Who keeps the replicas:

- a ``DataParallel`` wrapper keeps its own (:class:`ReplicaSets`), dropped with it, and runs one
  call at a time through them;
- :func:`replicate` keeps them in a process-wide table that holds the module only weakly. A
  module whose attributes or hooks lead back to it (a hook that is one of its bound methods, a
  config object holding it, a parameter hook or tensor attribute reading it) is not kept
  there, as the table would then keep it alive: it gets fresh replicas on every call, as in
  torch. Callers of :func:`replicate` with the same module
  and devices share one set: two threads running it at once should use
  :func:`fresh_replicate` (or a wrapper each).

Other folders import this stage through this module, never its private modules: ``__all__``
is its interface (``dataparallel`` re-exports the public names).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dataparallel._common.checks import replicate_scripted
from dataparallel.devices import DeviceSpec, resolve_devices
from dataparallel.replicate._check import Scripted, fingerprint
from dataparallel.replicate._compiled import (
    CompiledReplicas,
    check_compile_option,
    check_not_compiled,
    warn_compiled_wrapper,
)
from dataparallel.replicate._reach import self_referencing
from dataparallel.replicate._rebind import SERIAL, serial_mark
from dataparallel.replicate._replicas import Kept, Replicas
from dataparallel.replicate._written import check_writes

__all__ = [
    "SERIAL",
    "CompiledReplicas",
    "Kept",
    "ReplicaSets",
    "check_compile_option",
    "check_not_compiled",
    "check_writes",
    "clear_replica_cache",
    "fresh_replicate",
    "replicate",
    "serial_mark",
    "warn_compiled_wrapper",
]

_Devices = tuple[torch.device, ...]

_LOCK = threading.RLock()
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[_Devices, Replicas]] = weakref.WeakKeyDictionary()


def _prepare(module: nn.Module, devices: Sequence[DeviceSpec]) -> _Devices:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    return tuple(resolve_devices(devices, where="devices"))


def _replicas_of(
    table: dict[_Devices, Replicas],
    module: nn.Module,
    devices: _Devices,
    keep: Callable[[list[nn.Module], list[int] | None], bool],
) -> list[nn.Module]:
    """The replicas of ``module`` on ``devices`` from ``table``, built (and kept there when
    ``keep`` says so of the tree, or of the modules just refilled) when it has none for this
    structure."""
    entry = table.get(devices)
    previous = entry
    if entry is not None:
        fills = entry.fills
        replicas = entry.current_replicas(module)
        if replicas is not None:
            if entry.fills != fills and not keep(entry.modules(module), entry.refilled):
                del table[devices]
            return replicas
        del table[devices]
    try:
        modules, _ = fingerprint(module)
    except Scripted:
        return replicate_scripted(module, devices)
    entry = Replicas(module, devices)
    if previous is not None:  # (a frozen parameter's ``.data`` rebound: a new address)
        entry.adopt(previous)
    replicas = entry.current_replicas(module)
    if replicas is None:  # pragma: no cover - the structure changed while it was being built
        raise RuntimeError("module: its structure changed while its replicas were being built")
    if keep(modules, None):
        table[devices] = entry
    return replicas


def replicate(module: nn.Module, devices: Sequence[DeviceSpec]) -> list[nn.Module]:
    """One replica of ``module`` per entry of ``devices``, cached and re-synced on each call.

    The second call with an unchanged module returns the same replica objects; their state
    (training flags, parameters, buffers, plain attributes, hooks) always mirrors the module's,
    however it was written. Gradients of the replicas' outputs flow back into the module's own
    parameters.

    Args:
        module: the module to replicate; it is never modified.
        devices: device specs, one per replica; repeats are allowed (``["cpu", "cpu"]``,
            ``[0, 0]``).

    Returns:
        The replicas, in the order of ``devices``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or was compiled as a whole.
        ValueError: a device spec is not usable.

    Example:
        >>> import torch, dataparallel as dp
        >>> lin = torch.nn.Linear(3, 2)
        >>> a, b = dp.replicate(lin, ["cpu", "cpu"])
        >>> a.weight is lin.weight and dp.replicate(lin, ["cpu", "cpu"])[1] is b
        True
    """
    resolved = _prepare(module, devices)
    if isinstance(module, torch.jit.ScriptModule):  # its tensors live in C++: never cached
        return replicate_scripted(module, resolved)
    try:
        hash(module)
    except TypeError:  # a module class that defines __eq__ without __hash__: no cache
        return fresh_replicate(module, resolved)
    with _LOCK:
        table = _CACHE.get(module)
        if table is None:
            table = {}
            replicas = _replicas_of(table, module, resolved, _not_self_referencing)
            if table:
                _CACHE[module] = table
            return replicas
        return _replicas_of(table, module, resolved, _not_self_referencing)


def _not_self_referencing(modules: list[nn.Module], written: list[int] | None) -> bool:
    return not self_referencing(modules, written)


def _always(modules: list[nn.Module], written: list[int] | None) -> bool:
    return True


class ReplicaSets:
    """The replicas one owner (a ``DataParallel`` wrapper) keeps of one module.

    Held strongly by the owner, so no weak table and no self-reference check are needed: the
    replicas go with the owner. A new module (``wrapper.module = other``) drops the old sets.
    Not thread-safe: the owner runs one call at a time.
    """

    __slots__ = ("module", "sets", "shared")

    def __init__(self, *, shared: bool = False) -> None:
        self.module: nn.Module | None = None
        self.sets: dict[_Devices, Replicas] = {}
        # True: no sets of its own, :func:`replicate`'s process-wide table instead (the
        # functional form makes a wrapper per call, whose own sets would die with it).
        self.shared = shared

    def replicate(self, module: nn.Module, devices: Sequence[DeviceSpec]) -> list[nn.Module]:
        """As :func:`replicate`, from this owner's own sets."""
        if self.shared:
            return replicate(module, devices)
        resolved = _prepare(module, devices)
        if isinstance(module, torch.jit.ScriptModule):
            return replicate_scripted(module, resolved)
        if module is not self.module:
            self.module, self.sets = module, {}
        return _replicas_of(self.sets, module, resolved, _always)

    def refill(self, module: nn.Module, devices: Sequence[DeviceSpec]) -> None:
        """Have the next :meth:`replicate` of ``module`` on ``devices`` refill every replica's
        dictionary from the module (``Replicas.refill``): their last forwards wrote what is to
        be dropped. Nothing where none are kept."""
        resolved = _prepare(module, devices)
        table: dict[_Devices, Replicas] | None = None
        if self.shared:
            with _LOCK:
                table = _CACHE.get(module)
        elif module is self.module:
            table = self.sets
        entry = None if table is None else table.get(resolved)
        if entry is not None:
            entry.refill()

    def kept(self, module: nn.Module, devices: _Devices) -> Kept | None:
        """The replicas kept for ``devices`` (resolved, as ``replicate`` keys them), in line
        with ``module`` now: what :meth:`replicate` returns on a warm call, without resolving
        the devices again, with their serial mark (:func:`serial_mark`) and whether they hold
        an ``nn.SyncBatchNorm`` (``Replicas.kept``). ``None`` when none are kept for them, or
        the module's structure changed: :meth:`replicate` then builds them."""
        if module is not self.module:  # (a shared owner keeps no module: always here)
            return None
        entry = self.sets.get(devices)
        return None if entry is None else entry.kept(module)


def fresh_replicate(module: nn.Module, devices: Sequence[DeviceSpec]) -> list[nn.Module]:
    """Replicas built from scratch, bypassing the cache (torch's cost model).

    Same semantics as :func:`replicate`: the benchmark's baseline, and an escape hatch for a
    module run from several threads at once.

    Args:
        module: the module to replicate; it is never modified.
        devices: device specs, one per replica; repeats are allowed.

    Returns:
        New replicas, in the order of ``devices``: never the objects of an earlier call.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or was compiled as a whole.
        ValueError: a device spec is not usable.

    Example:
        >>> import torch, dataparallel as dp
        >>> lin = torch.nn.Linear(3, 2)
        >>> a, b = dp.fresh_replicate(lin, ["cpu", "cpu"])
        >>> dp.fresh_replicate(lin, ["cpu", "cpu"])[1] is b, torch.equal(b.weight, lin.weight)
        (False, True)
    """
    resolved = _prepare(module, devices)
    try:
        fingerprint(module)
    except Scripted:
        return replicate_scripted(module, resolved)
    return Replicas(module, resolved).sync_once(module)


def clear_replica_cache(module: nn.Module | None = None) -> None:
    """Forget the replicas :func:`replicate` keeps of ``module`` (all modules when ``None``).

    Never needed for correctness (every write to the module is seen); it frees the memory of
    the replicas' private copies at once. It raises nothing: a module with no replicas kept is
    left as it is. A ``DataParallel`` wrapper keeps its own replicas, which go with it.

    Args:
        module: the module whose replicas to forget; ``None``: every module's.

    Example:
        >>> import torch, dataparallel as dp
        >>> lin = torch.nn.Linear(3, 2)
        >>> _, b = dp.replicate(lin, ["cpu", "cpu"])  # (replica 0 is the module itself)
        >>> dp.clear_replica_cache(lin)
        >>> dp.replicate(lin, ["cpu", "cpu"])[1] is b  # built again
        False
    """
    with _LOCK:
        if module is None:
            _CACHE.clear()
        else:
            _CACHE.pop(module, None)
