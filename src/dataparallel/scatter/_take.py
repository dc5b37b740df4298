"""Scatter: execute a ``Plan``, giving each device its slice of the batch.

The plan decides; this module only cuts and moves. ``take`` builds the arguments of one slice
``[start, start + length)`` on one device, so the same code serves ``scatter`` (one slice per
device), ``DataParallel``'s waves and ``dataparallel.distributed.shard`` (one rank's slice).
Every step is differentiable: tensors are cut with ``narrow`` and moved with ``to``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.nn.utils.rnn import pad_packed_sequence

from dataparallel._common.kinds import ATOMS, LIST, item_types, struct_items
from dataparallel._common.movable import contains_record, move_item
from dataparallel._common.packed import take_packed
from dataparallel._common.rebuild import rebuild
from dataparallel._common.tree import TooDeep, contains_array, map_tensors
from dataparallel.markers import Shared, Split
from dataparallel.plan import BroadcastCut, Cut, PerSampleCut, Plan, Rebuild, SplitCut, Step

__all__ = ["take"]

_IS_CPU = operator.attrgetter("is_cpu")  # True for CPU tensors only (not meta, not CUDA)
_CPU = torch.device("cpu")  # equal only to device(type='cpu'), not to 'cpu:0'
# Exact types that are never a dp.Shared or dp.Split.


_MOVERS: dict[tuple[torch.device, torch.dtype | None], Any] = {}


def _mover(device: torch.device, dtype: torch.dtype | None) -> Any:
    """A function that moves one tensor to ``device``, casting floats to ``dtype``.

    Copies to a CUDA device are non-blocking: from pinned host memory they overlap with other
    work, and the replica's stream orders them before its forward. Made once per
    ``(device, dtype)`` and kept: every chunk of every call needs one (it holds no state).
    """
    key = (device, dtype)
    move = _MOVERS.get(key)
    if move is None:
        move = _MOVERS[key] = _make_mover(device, dtype)
    return move


# torch's own move, never a tensor subclass's Python ``to`` (BigGAN's ``Distribution.to`` reads
# attributes its slices lack): as ``torch._C._scatter`` moves the pieces.
_TO = torch.Tensor.to


def _make_mover(device: torch.device, dtype: torch.dtype | None) -> Any:
    non_blocking = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return _TO(t, device=device, dtype=dtype, non_blocking=non_blocking)
        if t.device == device:
            return t
        return _TO(t, device=device, non_blocking=non_blocking)

    # Without a cast, a tensor already on ``device`` is returned as is: per-sample lists test
    # that inline instead of calling ``move`` for every item.
    move.device = device if dtype is None else None  # type: ignore[attr-defined]
    move.target = device  # type: ignore[attr-defined]  # where records' own .to sends them
    return move


def _run(step: Step, obj: Any, start: int, length: int, move: Any, move_plain: Any) -> Any:
    """What one program step gives for ``obj``, the argument at its position, for the slice
    ``[start, start + length)``."""
    if type(step) is SplitCut and type(obj) is torch.Tensor:  # the common leaf, first
        return (move if step.cast else move_plain)(_narrow(obj, step.dim, start, length))
    if isinstance(step, Rebuild):
        cls = type(obj)
        if cls is tuple or cls is list:  # plain containers: no template to keep
            items = [
                _run(c, v, start, length, move, move_plain)
                for c, v in zip(step.children, obj, strict=True)
            ]
            return tuple(items) if cls is tuple else items
        if cls is dict:
            return {
                key: _run(c, v, start, length, move, move_plain)
                for c, (key, v) in zip(step.children, obj.items(), strict=True)
            }
        keys, values = struct_items(obj, step.kind)
        results = [
            _run(c, v, start, length, move, move_plain)
            for c, v in zip(step.children, values, strict=True)
        ]
        return rebuild(step.kind, obj, keys, results)
    if not isinstance(step, Cut):  # pragma: no cover - internal invariant
        raise TypeError(f"unknown program step {step!r}")
    if step.unwrap:  # a dp.Split or dp.Shared: its inside
        obj = obj.obj
    fn = move if step.cast else move_plain
    if isinstance(step, SplitCut):
        dim = step.dim
        if isinstance(obj, torch.Tensor):
            return fn(_narrow(obj, dim, start, length))
        index = [slice(None)] * obj.ndim
        index[dim] = slice(start, start + length)
        return obj[tuple(index)]
    if isinstance(step, BroadcastCut):
        try:
            moves = step.moves
            if moves is None:  # the value's types did not say: look
                moves = contains_array(obj)
            return map_tensors(obj, fn, move_plain) if moves else obj
        except TooDeep:  # a cycle inside a broadcast value: the plan did not walk it
            raise TooDeep(step.path) from None
    if isinstance(step, PerSampleCut):
        return _per_sample(step, obj, start, length, fn, move_plain)
    padded, lengths = pad_packed_sequence(obj, batch_first=True)  # a PackedCut
    return take_packed(padded, lengths, start, length, move)


def _narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Samples ``[start, start + length)`` of ``t`` along ``dim``: a view (the whole batch is
    ``t`` itself); a sparse COO tensor has no views, so a copy of the slice (differentiable)."""
    if dim == 0 and type(t) is torch.Tensor and not t.is_sparse:
        # The same view (and the same SliceBackward0) as narrow, at two thirds of its dispatch
        # cost. A subclass keeps narrow: its __getitem__ may mean something else.
        return t if not start and length == t.shape[0] else t[start : start + length]
    if not start and length == t.shape[dim]:
        return t
    if t.is_sparse:
        return t.narrow_copy(dim, start, length)
    return t.narrow(dim, start, length)


def _per_sample(
    step: PerSampleCut, obj: Any, start: int, length: int, fn: Any, move_plain: Any
) -> Any:
    """A sequence's items ``[start, start + length)``, with the tensors among them moved."""
    items = obj[start : start + length]
    # A plain list's slice is a new plain list already: kept as it is, not copied and rebuilt.
    plain = type(obj) is list
    holds = step.holds_arrays
    try:
        if holds is None:  # the item types did not say: look at this chunk's items
            holds = any(contains_array(item) or contains_record(item) for item in items)
        if holds:
            tensor = torch.Tensor
            here = fn.device
            # An exact tensor is moved directly (or kept, when it is already on the device and
            # nothing is cast): what map_tensors would do, minus its walk.
            target = fn.target
            if here == _CPU and item_types(items) == {tensor} and all(map(_IS_CPU, items)):
                # Every item an exact tensor on the CPU (whose tensors all report
                # device(type='cpu'), never an index), so each is kept, as the line below does.
                if not plain:
                    items = list(items)
            elif here is not None:
                items = [
                    x
                    if type(x) is tensor and x.device == here
                    else move_item(x, fn, move_plain, target)
                    for x in items
                ]
            else:
                items = [
                    fn(x) if type(x) is tensor else move_item(x, fn, move_plain, target)
                    for x in items
                ]
        elif item_types(items) <= ATOMS:  # names, ids, numbers: no marker to unwrap
            if not plain:
                items = list(items)
        else:
            items = [item.obj if isinstance(item, (Shared, Split)) else item for item in items]
    except TooDeep:  # a cycle inside an item: the plan did not walk it
        raise TooDeep(step.path) from None
    if plain:
        return items
    if isinstance(obj, tuple):  # a dp.Split tuple (a namedtuple's chunk is a tuple)
        return tuple(items)
    return rebuild(LIST, obj, [], items)


def take(plan: Plan, start: int, length: int, device: torch.device) -> tuple[Any, dict[str, Any]]:
    """The arguments of the slice ``[start, start + length)`` of a planned call on ``device``.

    Returns ``(args, kwargs)``: ``args`` is a tuple when the planned inputs were a tuple, else
    the chunk of the one argument. ``length`` may be 0 (empty tensors and lists). A program
    marked ``identity`` gives back the call's own arguments.
    """
    program = plan.program
    if program is None or plan.kwargs is None:
        raise ValueError("plan: expected a plan made by dataparallel.plan, got an empty one")
    if program.identity:
        return plan.inputs, plan.kwargs  # type: ignore[return-value]
    move = _mover(device, plan.dtype)
    move_plain = move if plan.dtype is None else _mover(device, None)
    args = _run(program.args, plan.inputs, start, length, move, move_plain)
    if not program.kw_keys:
        return args, {}
    kwargs = plan.kwargs
    kw = {
        key: _run(step, kwargs[key], start, length, move, move_plain)
        for key, step in zip(program.kw_keys, program.kw_steps, strict=True)
    }
    return args, kw
