"""Scatter: execute a ``Plan``, giving each device its slice of the batch.

The plan decides; this module only cuts and moves. ``take`` builds the arguments of one slice
``[start, start + length)`` on one device, so the same code serves ``scatter`` (one slice per
device), ``DataParallel``'s waves and ``dataparallel.distributed.shard`` (one rank's slice).
Every step is differentiable: tensors are cut with ``narrow`` and moved with ``to``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataparallel._movable import move_item
from dataparallel._packed import take_packed
from dataparallel._tree import LIST, TooDeep, map_tensors, rebuild
from dataparallel._warn import warn_user
from dataparallel.devices import DeviceSpec, resolve_devices
from dataparallel.markers import Shared, Split
from dataparallel.plan import build_plan, check_options
from dataparallel.plan._program import (
    BroadcastNode,
    Node,
    PackedNode,
    PerSampleNode,
    Plan,
    SplitNode,
    StructNode,
)

__all__ = ["scatter", "scatter_kwargs", "take"]


def _mover(device: torch.device, dtype: torch.dtype | None) -> Any:
    """A function that moves one tensor to ``device``, casting floats to ``dtype``.

    Copies to a CUDA device are non-blocking: from pinned host memory they overlap with other
    work, and the replica's stream orders them before its forward.
    """
    non_blocking = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return t.to(device=device, dtype=dtype, non_blocking=non_blocking)
        if t.device == device:
            return t
        return t.to(device=device, non_blocking=non_blocking)

    # Without a cast, a tensor already on ``device`` is returned as is: per-sample lists test
    # that inline instead of calling ``move`` for every item.
    move.device = device if dtype is None else None  # type: ignore[attr-defined]
    move.target = device  # type: ignore[attr-defined]  # where records' own .to sends them
    return move


def _run(node: Node, start: int, length: int, move: Any, move_plain: Any) -> Any:
    """The result of one compiled node for the slice ``[start, start + length)``."""
    if isinstance(node, SplitNode):
        obj = node.obj
        if isinstance(obj, torch.Tensor):
            if start or length != obj.shape[node.dim]:  # the whole batch needs no narrow
                if obj.is_sparse:  # COO has no views: a copy of the slice (differentiable)
                    obj = obj.narrow_copy(node.dim, start, length)
                else:
                    obj = obj.narrow(node.dim, start, length)
            return (move if node.cast else move_plain)(obj)
        index = [slice(None)] * obj.ndim
        index[node.dim] = slice(start, start + length)
        return obj[tuple(index)]
    if isinstance(node, StructNode):
        values = [_run(c, start, length, move, move_plain) for c in node.children]
        return rebuild(node.kind, node.template, node.keys, values)
    if isinstance(node, PerSampleNode):
        items = node.obj[start : start + length]
        if node.holds_arrays:
            fn = move if node.cast else move_plain
            tensor = torch.Tensor
            here = fn.device
            # An exact tensor is moved directly (or kept, when it is already on the device and
            # nothing is cast): what map_tensors would do, minus its walk.
            target = fn.target
            try:
                if here is not None:
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
            except TooDeep:  # a cycle inside an item: the plan did not walk it
                raise TooDeep(node.path) from None
        else:
            items = [item.obj if isinstance(item, (Shared, Split)) else item for item in items]
        if isinstance(node.obj, tuple):  # a dp.Split tuple (a namedtuple's chunk is a tuple)
            return tuple(items)
        return rebuild(LIST, node.obj, [], items)
    if isinstance(node, PackedNode):
        return take_packed(node.padded, node.lengths, start, length, move)
    if isinstance(node, BroadcastNode):
        if not node.moves:
            return node.obj
        try:
            return map_tensors(node.obj, move if node.cast else move_plain, move_plain)
        except TooDeep:  # a cycle inside a broadcast value: the plan did not walk it
            raise TooDeep(node.path) from None
    raise TypeError(f"unknown plan node {node!r}")  # pragma: no cover - internal invariant


def take(plan: Plan, start: int, length: int, device: torch.device) -> tuple[Any, dict[str, Any]]:
    """The arguments of the slice ``[start, start + length)`` of a planned call on ``device``.

    Returns ``(args, kwargs)``: ``args`` is a tuple when the planned inputs were a tuple, else
    the chunk of the one argument. ``length`` may be 0 (empty tensors and lists).
    """
    move = _mover(device, plan.dtype)
    move_plain = move if plan.dtype is None else _mover(device, None)
    if plan.root_args is None or plan.root_kwargs is None:
        raise ValueError("plan: expected a plan made by dataparallel.plan, got an empty one")
    args = _run(plan.root_args, start, length, move, move_plain)
    kwargs = _run(plan.root_kwargs, start, length, move, move_plain)
    return args, kwargs


def emit_warnings(plan: Plan) -> None:
    """Warn with the plan's messages (Python's filter shows each once per call site)."""
    for message in plan.warnings:
        warn_user(message)


def _one_round(plan: Plan) -> list[tuple[torch.device, int, int]]:
    return plan.slices[0]


def scatter(
    inputs: Any, devices: DeviceSpec | Sequence[DeviceSpec] | None, dim: int = 0, **opts: Any
) -> list[Any]:
    """Split ``inputs`` over ``devices`` under the batch rules; one entry per device used.

    Each entry is a tuple of arguments when ``inputs`` is a tuple, else that device's chunk.

    >>> import torch, dataparallel as dp
    >>> [c.shape[0] for c in dp.scatter(torch.zeros(10, 2), ["cpu", "cpu", "cpu"])]
    [4, 3, 3]
    """
    check_options(opts)
    p = build_plan(inputs, None, resolve_devices(devices), dim, allow_waves=False, **opts)
    emit_warnings(p)
    return [take(p, start, length, device)[0] for device, start, length in _one_round(p)]


def scatter_kwargs(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: DeviceSpec | Sequence[DeviceSpec] | None,
    dim: int = 0,
    **opts: Any,
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """Split positional and keyword arguments together: per-device args tuples and kwargs.

    Both results have one entry per device used; every device gets every keyword argument.
    ``inputs`` that is not a tuple is taken as one positional argument.
    """
    check_options(opts)
    args = inputs if type(inputs) is tuple else (inputs,)
    p = build_plan(args, kwargs, resolve_devices(devices), dim, allow_waves=False, **opts)
    emit_warnings(p)
    chunks = [take(p, start, length, device) for device, start, length in _one_round(p)]
    return tuple(a for a, _ in chunks), tuple(k for _, k in chunks)
