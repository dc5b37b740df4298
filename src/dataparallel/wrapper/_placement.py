"""Where the wrapped module's tensors are: the device check, and replica 0's writes copied back.

``DataParallel`` requires the module on ``device_ids[0]``, as torch's does. Checking every
parameter on every call would cost a walk over a deep module, so the full check runs once and
then two *sentinels* stand for it: the first and the last tensor of the module, found again by
their place on each call (``model.to(...)`` moves them too). A misplaced tensor the sentinels
miss makes torch raise in the forward, and the wrapper then runs the full check for a clear
message.

A sentinel is a place, not a tensor: its module (held weakly), its table and its name. Nothing
is attached to the user's tensors (a weak reference to one makes ``torch.utils.swap_tensors``,
and so ``module.to()`` under ``set_swap_module_params_on_conversion(True)``, refuse it), and a
tensor the user replaces is freed at once; a place that no longer holds a tensor means a full
check.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dataparallel._common.kinds import ATOMS
from dataparallel.parallel_apply import infer_device

__all__: list[str] = []

_CPU = torch.device("cpu")

# The two sentinels, flat: for the first and the last tensor, its module (held weakly),
# "_parameters" or "_buffers", and its name; ``()`` for a module without a tensor.
Sentinels = tuple[Any, ...]


def same_device(found: torch.device, expected: torch.device) -> bool:
    """Whether a tensor on ``found`` is where ``expected`` wants it: any CPU index is the CPU
    (``"cpu:1"`` names a second CPU replica, but a tensor cannot be moved "to" it)."""
    return found == expected or (found.type == "cpu" and expected.type == "cpu")


def sentinels_hold(sentinels: Sentinels | None, device: torch.device) -> bool:
    """Whether the sentinels still hold tensors, all on ``device`` (then no full check).

    Read on every call, so flat: one unpacking, two look-ups, no loop. Anything that fails
    (no sentinels yet, a freed module, which has no table, a name no longer in its table, a
    ``None`` there, which has no device) means the full check."""
    try:  # (None, no sentinels yet: a TypeError)
        ref, table, name, last_ref, last_table, last_name = sentinels  # type: ignore[misc]
        first = getattr(ref(), table)[name]
        last = getattr(last_ref(), last_table)[last_name]
        # (device.type builds a string on each read; is_cpu is a flag)
        if device == _CPU and first.is_cpu and last.is_cpu:
            return True
        return _on(first, device) and _on(last, device)
    except (TypeError, ValueError, AttributeError, KeyError):
        return sentinels == ()  # a module without a tensor has nothing to misplace


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device == device or (t.is_cpu and device.type == "cpu")


def sentinels_of(module: nn.Module) -> Sentinels:
    """The places of ``module``'s first and last tensor (``()`` for a module without one)."""
    found = [
        (weakref.ref(m), table, name)
        for m in module.modules()
        for table in ("_parameters", "_buffers")
        for name, t in getattr(m, table).items()
        if t is not None
    ]
    return (*found[0], *found[-1]) if found else ()


def check_module_device(state: dict[str, Any], module: nn.Module, device: torch.device) -> None:
    """The module must be on ``device`` (``device_ids[0]``): checked in full on the first call
    (a wrapper's ``__dict__``, ``state``, keeps the sentinels), then through the sentinels, so
    a deep module does not pay a walk over every parameter per call."""
    if sentinels_hold(state.get("_sentinels"), device):
        return
    check_on_device(module, device)
    state["_sentinels"] = sentinels_of(module)


def check_on_device(module: nn.Module, device: torch.device) -> None:
    """Raise a RuntimeError naming the first parameter or buffer of ``module`` that is not on
    ``device`` (``device_ids[0]``), with the fix."""
    if _all_on(module, device):  # the cheap walk; names only on failure
        return
    for name, tensor in _named_tensors(module):
        if not same_device(tensor.device, device):
            # "cpu:1" is a replica slot, not a place: the tensor goes to the CPU
            where = "cpu" if device.type == "cpu" else str(device)
            if tensor.device.type == "meta":  # no data to move, and no device to list
                raise RuntimeError(
                    f"module: expected its parameters and buffers on {device} "
                    f"(device_ids[0]), found {name!r} on the meta device, which holds no data "
                    f"(and is refused in device_ids); materialise the module first, "
                    f"model.module.to_empty(device={where!r}) and then load its weights "
                    f"(load_state_dict)"
                )
            raise RuntimeError(
                f"module: expected its parameters and buffers on {device} (device_ids[0]), "
                f"found {name!r} on {tensor.device}; move it first with "
                f"model.module.to({where!r}), or list {str(tensor.device)!r} first in "
                f"device_ids"
            )


# Plain attribute values a forward's write is copied back for: immutable values (``ATOMS``),
# which a replica holds as its own (a mutable object such as a list is shared with the module
# anyway; tensors, modules and functions a replica holds are its own copies or rebound).
_VALUES = ATOMS
# nn.Module's own bookkeeping (training flag, tables, hook flags): never written back.
_MODULE_NAMES = frozenset(nn.Module().__dict__)


def plain_attributes(replica: nn.Module) -> list[dict[str, Any]]:
    """Each module of ``replica``'s plain attributes of immutable values, as they are now: what
    ``copy_writes_back`` compares with after the forward, when something other than the module
    (a ``replicate`` override, its ``__data_parallel_replicate__`` callbacks) wrote the replica
    before it ran."""
    return [
        {k: v for k, v in m.__dict__.items() if type(v) in _VALUES and k not in _MODULE_NAMES}
        for m in replica.modules()
    ]


def copy_writes_back(
    replica: nn.Module, module: nn.Module, before: list[dict[str, Any]] | None = None
) -> None:
    """Give the module what replica 0's forward wrote, after a call that did not run it as
    replica 0: its buffers and its plain attributes of immutable values (``self.calls += 1``).

    That happens when ``device_ids[0]`` got no chunk (``chunk_sizes=[0, ...]``, a zero
    weight), or is another slot than the module's (``["cpu:1", ...]``): replica 0 then ran on
    private buffers and attributes, and without this the module's BatchNorm statistics and
    counters would never update, where replica 0 as the module itself updates them once per
    call. Only the buffers replica 0's forward changed are written, as the forward on one device
    would have: an earlier call's graph may have saved the others (BatchNorm in ``eval()``, a
    buffer used as a factor, directly or through ``.detach()``), and an in-place write, even of
    the same value, would break its backward. Values are compared, since BatchNorm updates its
    running statistics without bumping their version; the cost (one comparison per buffer and
    per attribute) is paid only by calls whose replica 0 is not the module itself. Attributes:
    a replica starts each call with the module's values (replicate keeps them in sync), so a
    value that differs after the forward is one the forward wrote. Where ``replicate`` is
    overridden, its callbacks may write the replica before the forward (Synchronized-BatchNorm
    tags it ``_is_parallel = True``): ``before`` (``plain_attributes`` taken just before the
    forward) is then what a value is compared with, so only the forward's own writes land.
    """
    with torch.no_grad():
        # (paired by name: a forward may have deleted one from the replica, or re-made it as
        # a plain tensor, ``del self.lin.weight; self.lin.weight = w * 0.5``)
        theirs_by_name = dict(replica.named_buffers())
        for name, mine in module.named_buffers():
            theirs = theirs_by_name.get(name)
            if theirs is None or mine is theirs:
                continue
            value = theirs.to(mine.device)
            if mine.shape != value.shape:  # (resized in place by the forward: as one device)
                mine.resize_(value.shape)
                mine.copy_(value)
            elif mine.dtype != value.dtype or not mine.equal(value):
                mine.copy_(value)
        # Parameters that do not require grad, as buffers (an EMA teacher, a counter): one
        # device writes them once per call (``replicate._written``); replica 0 wrote its copy.
        # A copy-on-write clone that is one still was not written: no comparison.
        theirs_by_name = dict(replica.named_parameters())
        for name, mine in module.named_parameters():
            theirs = theirs_by_name.get(name)
            if theirs is None or mine is theirs or mine.requires_grad or _IS_COW(theirs):
                continue
            value = theirs.to(mine.device)
            if mine.shape != value.shape or mine.dtype != value.dtype or not mine.equal(value):
                mine.copy_(value)
    for i, (own, copy) in enumerate(zip(module.modules(), replica.modules(), strict=True)):
        if own is copy:
            continue
        attributes = own.__dict__
        base = attributes if before is None else before[i]
        for name, value in copy.__dict__.items():
            if (
                type(value) in _VALUES
                and name in attributes
                and name not in _MODULE_NAMES
                and base.get(name, _MISSING) is not value
                and base.get(name, _MISSING) != value
            ):
                attributes[name] = value  # (as the forward's own write: no __setattr__ hook)


_MISSING = object()
_IS_COW = torch._C._is_cow_tensor  # type: ignore[attr-defined]


def _all_on(module: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device`` (no names built)."""
    return all(
        t is None or same_device(t.device, device)
        for m in module.modules()
        for group in (m._parameters, m._buffers)
        for t in group.values()
    )


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def run_here(
    d: dict[str, Any], module: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Make a copy of a nested wrapper (its ``__dict__`` ``d``, its ``module``) run its calls on
    its replica's own device.

    A wrapper inside a wrapped module (``model.encoder = dp.DataParallel(enc)``) is
    replicated with it. Replica 0 is the wrapper itself: its calls split replica 0's chunk
    over its own devices. Each other replica holds a copy (``_replicate_for_data_parallel``)
    whose module is that replica's copy, on that replica's device: the copy runs its chunk
    there, as one device (``device_ids[0]`` may be a device the copy's tensors are not on).
    The outer wrapper has already split the batch, so the result is one device's either way.
    """
    if d.get("_here") is None:
        device = infer_device(module, inputs, kwargs)
        d["device_ids"] = [device]
        d["src_device_obj"] = d["output_device"] = device
        d["options"] = {**d["options"], "chunk_sizes": None, "weights": None}
        d["_here"] = device
