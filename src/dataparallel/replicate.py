"""Replicate a module onto devices, once, and keep the replicas in step with it.

``torch.nn.parallel.replicate`` rebuilds every replica on every forward: one Python object per
submodule per device, a ``__dict__`` copy each, and a broadcast of every parameter even when
nothing changed. Here the replica objects (:class:`dataparallel.replicas.Replicas`) are built
once per (module, devices) and kept in a side table keyed weakly on the module. Each call then
costs what can have changed:

- nothing counted since the last call (:mod:`dataparallel.mutations`: no attribute set, no
  submodule, parameter, buffer or hook added, replaced or removed, no ``.to()``): only the
  tensors are re-synced, parameter copies on other devices and private buffer copies;
- some change counted: the structure is compared with the one the replicas were built for
  (:mod:`dataparallel.fingerprint`); a new structure rebuilds the replicas, else every
  replica's ``__dict__`` is refilled from its source's (attributes, training flags, hooks).

Replicas never register the module as a child and do not expose parameters
(``replica.parameters()`` is empty, as in torch), so they never appear in
``module.state_dict()``. The side table holds the root module only weakly; a module whose hooks
or attributes refer back to it (a hook that is one of its bound methods, say) is not cached, as
the table would then keep it alive: it gets fresh replicas on every call, as in torch.

Replicas are shared by every caller of ``replicate(module, devices)``: two threads running the
same module on the same devices at once should use :func:`fresh_replicate`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from dataparallel import mutations
from dataparallel.devices import DeviceSpec, resolve_devices
from dataparallel.fingerprint import Scripted, fingerprint, self_referencing
from dataparallel.guards import replicate_scripted
from dataparallel.replicas import Replicas

__all__ = ["clear_replica_cache", "fresh_replicate", "replicate"]

_LOCK = threading.RLock()
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[torch.device, ...], Replicas]] = (
    weakref.WeakKeyDictionary()
)


def _prepare(module: nn.Module, devices: Sequence[DeviceSpec]) -> tuple[torch.device, ...]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    return tuple(resolve_devices(devices, where="devices"))


def replicate(module: nn.Module, devices: Sequence[DeviceSpec]) -> list[nn.Module]:
    """One replica of ``module`` per entry of ``devices``, cached and re-synced on each call.

    The second call with an unchanged module returns the same replica objects; their state
    (training flags, parameters, buffers, plain attributes) always mirrors the module's.
    Gradients of the replicas' outputs flow back into the module's own parameters.

    Args:
        module: the module to replicate; it is never modified.
        devices: device specs, one per replica; repeats are allowed (``["cpu", "cpu"]``,
            ``[0, 0]``).

    Returns:
        The replicas, in the order of ``devices``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: a device spec is not usable.

    >>> lin = torch.nn.Linear(3, 2)
    >>> a, b = replicate(lin, ["cpu", "cpu"])
    >>> a.weight is lin.weight and replicate(lin, ["cpu", "cpu"])[1] is b
    True
    """
    resolved = _prepare(module, devices)
    if isinstance(module, torch.jit.ScriptModule):  # its tensors live in C++: never cached
        return replicate_scripted(module, resolved)
    try:
        hash(module)
    except TypeError:  # a module class that defines __eq__ without __hash__: no cache
        return fresh_replicate(module, resolved)
    mutations.install()
    with _LOCK:
        table = _CACHE.get(module)
        entry = None if table is None else table.get(resolved)
        # Read before anything is looked at: a change made from here on moves it again.
        now = mutations.epoch()
        if entry is not None and entry.epoch == now and mutations.tracking():
            return entry.refresh(module)  # nothing changed: tensors only
        if entry is not None and not entry.unchanged(module):
            entry = None
            del table[resolved]  # type: ignore[union-attr]
        if entry is None:
            try:
                modules, _ = fingerprint(module)
            except Scripted:
                return replicate_scripted(module, resolved)
            entry = Replicas(module, resolved)
            if self_referencing(modules):
                # The table would keep the module alive through its own replicas.
                return entry.sync(module)
            _CACHE.setdefault(module, {})[resolved] = entry
        replicas = entry.sync(module)
        entry.epoch = now if entry.trusted else None
        return replicas


def fresh_replicate(module: nn.Module, devices: Sequence[DeviceSpec]) -> list[nn.Module]:
    """Replicas built from scratch, bypassing the cache (torch's cost model).

    Same semantics as :func:`replicate`: the benchmark's baseline, and an escape hatch for a
    module run from several threads at once.
    """
    resolved = _prepare(module, devices)
    try:
        fingerprint(module)
    except Scripted:
        return replicate_scripted(module, resolved)
    return Replicas(module, resolved).sync(module)


def clear_replica_cache(module: nn.Module | None = None) -> None:
    """Forget cached replicas of ``module`` (all modules when ``None``); the next call rebuilds.

    Needed only after changes that bypass torch's mutation methods (``module.__dict__[k] = v``,
    ``module._modules[k] = m``, ``module._parameters[k] = p``), which the change count cannot
    see (:mod:`dataparallel.mutations`).
    """
    with _LOCK:
        if module is None:
            _CACHE.clear()
        else:
            _CACHE.pop(module, None)
