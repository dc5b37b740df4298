"""A wrapper's last plan, reused while the call's signature holds.

Most training loops call a model with the same structure of arguments, of the same shapes, on
every step. For such calls the plan (which input is split, which broadcast, the chunk sizes,
the warnings) is a function of the signature alone: the type, shape, dtype, device and layout
of every argument, the keyword names, the devices, ``dim`` and the options. ``PlanCache.get``
builds a plan on a miss, keeps a template of it without the tensors (so no batch is kept
alive between calls), and on a hit makes a plan for the new tensors from the template.

Only calls whose arguments are all plain dense tensors (exactly ``torch.Tensor``, at the top
of the argument tuple or the keyword dict) are cached: for them the signature is a few
attribute reads. Anything else (containers, lists, markers, ndarrays, subclasses) takes
``build_plan`` every time, as before, with one exception: a wrapper of one device and no batch
options asks only for the batch size (:func:`whole_batch`), since one chunk of the whole batch
splits nothing and so cannot broadcast anything in place of a split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dataparallel._tree import TooDeep, map_tensors
from dataparallel.plan._program import BroadcastNode, Node, Plan, SplitNode, StructNode
from dataparallel.plan._rules import build_plan, vote_batch_size
from dataparallel.scatter import _mover, take

__all__ = ["PlanCache", "signature", "take_flat", "take_whole", "whole_batch"]

_Tensor = torch.Tensor
_STRIDED = torch.strided
_FROZEN = (type(None), bool, int, float, str, torch.dtype)


def signature(inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What the plan of a call of plain dense tensors depends on, or ``None`` for other calls.

    >>> signature((torch.zeros(4, 2),), {})
    ((torch.Size([4, 2]), torch.float32, device(type='cpu')),)
    >>> signature(([torch.zeros(4, 2)],), {}) is None
    True
    """
    sig: list[Any] = []
    for a in inputs:
        if type(a) is not _Tensor or a.layout is not _STRIDED or a.is_nested:
            return None
        sig.append((a.shape, a.dtype, a.device))
    for k, a in kwargs.items():
        if type(a) is not _Tensor or a.layout is not _STRIDED or a.is_nested:
            return None
        sig.append((k, a.shape, a.dtype, a.device))
    return tuple(sig)


def _freeze(options: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The options as a comparable tuple, or ``None`` when a value cannot be compared cheaply
    and safely (an ndarray or a tensor of chunk sizes: such calls are not cached)."""
    out: list[Any] = []
    for k, v in options.items():
        if type(v) in _FROZEN:
            out.append((k, v))
        elif type(v) in (list, tuple) and all(type(x) in (int, float) for x in v):
            out.append((k, tuple(v)))
        else:
            return None
    return tuple(out)


def _leaf(node: Node) -> tuple[Any, ...]:
    """A compiled leaf without its tensor: what a new tensor of the same signature needs."""
    if type(node) is SplitNode:
        return (True, node.dim, node.cast, None)
    if type(node) is BroadcastNode:
        return (False, node.moves, node.cast, node.path)
    raise TypeError(f"not a leaf of a cached plan: {node!r}")  # pragma: no cover - invariant


def _node(leaf: tuple[Any, ...], obj: _Tensor) -> Node:
    split, a, cast, path = leaf
    if split:
        return SplitNode(obj, a, cast)
    node = BroadcastNode.__new__(BroadcastNode)
    node.obj, node.moves, node.cast, node.path = obj, a, cast, path
    return node


class PlanCache:
    """One wrapper's last plan template and the key it was built for.

    Safe under concurrent calls: the entry is one tuple, replaced whole, and a hit builds a
    new ``Plan`` (nothing cached is mutated).
    """

    __slots__ = ("entry", "whole")

    def __init__(self) -> None:
        self.entry: tuple[Any, ...] | None = None
        self.whole: Plan | None = None  # the last whole-batch plan, reused for the same B

    def get(
        self,
        inputs: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        devices: list[torch.device],
        dim: int,
        options: Mapping[str, Any],
        *,
        bare: bool = False,
    ) -> Plan:
        """The plan ``build_plan(inputs, kwargs, devices, dim, **options)`` would make.

        With ``bare=True``, a reused plan comes without its compiled tree: the caller cuts its
        chunks with :func:`take_flat` (the plan's ``__dict__`` holds ``"flat"``). A plan whose
        one chunk is the whole batch on the device where every tensor already is, with no
        cast, also has ``"moves_nothing"``: its scatter returns the arguments themselves.
        """
        sig = signature(inputs, kwargs)
        if sig is None and bare and len(devices) == 1 and not any(options.values()):
            # (getattr: a cache unpickled from a version without the slot lacks it)
            whole = whole_batch(inputs, kwargs, devices[0], dim, getattr(self, "whole", None))
            if whole is not None:
                self.whole = whole
                return whole
        frozen = None if sig is None else _freeze(options)
        entry = self.entry
        if (
            frozen is not None
            and entry is not None
            and entry[0] == sig
            and entry[1] == dim
            and entry[2] == frozen
            and entry[3] == devices
        ):
            template = entry[4]
            if bare:  # the caller scatters with ``take_flat`` (or not at all)
                plan = Plan.__new__(Plan)
                plan.__dict__.update(template.__dict__)
                return plan
            return _instantiate(template, entry[5], entry[6], inputs, kwargs)
        plan = build_plan(inputs, kwargs, devices, dim, **options)
        if frozen is not None and isinstance(plan.root_args, StructNode):
            arg_leaves = [_leaf(c) for c in plan.root_args.children]
            kw_leaves = [_leaf(c) for c in plan.root_kwargs.children]  # type: ignore[union-attr]
            template = Plan.__new__(Plan)
            template.__dict__.update(plan.__dict__)
            # Nothing that holds the call's tensors: the template outlives the call.
            template.root_args = template.root_kwargs = None
            template.entry_records = []
            template.__dict__.pop("_entries", None)
            template.__dict__["flat"] = (arg_leaves, kw_leaves)
            if _moves_nothing(plan, inputs, kwargs):
                template.__dict__["moves_nothing"] = True
            self.entry = (sig, dim, frozen, list(devices), template, arg_leaves, kw_leaves)
        return plan


def whole_batch(
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    device: torch.device,
    dim: int,
    last: Plan | None = None,
) -> Plan | None:
    """A bare plan of one chunk, the whole batch on ``device``, or ``None`` when the vote alone
    does not give ``B`` (a ``dp.Split``, an iterator, a ``PackedSequence``, no batch, an input
    the plan refuses): the caller then builds the full plan, which decides or names the error.

    With one chunk nothing is split, so the plan's rules only decide ``B`` (for ``last_call``
    and gather); the scatter is :func:`take_whole`. The plan's ``__dict__`` holds ``"whole"``.
    """
    try:
        batch = vote_batch_size(inputs, kwargs, dim)
    except (TooDeep, ValueError, TypeError):
        return None
    if not batch:
        return None
    if (
        last is not None
        and last.batch_size == batch
        and last.dim == dim
        and last.devices[0] == device
    ):
        return last  # bare plans are never changed by their users: one serves every such call
    plan = Plan(
        batch_size=batch,
        devices=[device],
        chunk_sizes=[batch],
        entry_records=[],
        votes=[],
        waves=[[batch]],
        decided_by="vote",
        dim=dim,
        slices=[[(device, 0, batch)]],
        device_sizes=[[batch]],
    )
    plan.__dict__["whole"] = True
    return plan


def take_whole(
    inputs: tuple[Any, ...], kwargs: Mapping[str, Any], device: torch.device
) -> tuple[Any, Any] | None:
    """The one chunk of a :func:`whole_batch` plan: the arguments with their tensors on
    ``device`` (a tensor already there is passed as it is; containers are rebuilt) and markers
    unwrapped; ``None`` for arguments nested too deep (the full plan names them)."""

    move = _mover(device, None)
    try:
        return map_tensors(inputs, move), map_tensors(kwargs, move) if kwargs else kwargs
    except TooDeep:
        return None


def take_flat(
    plan: Plan,
    wave: list[tuple[torch.device, int, int]],
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """The chunks of one wave of a bare reused plan: what ``take`` gives for each
    ``(device, start, length)``, cut straight from the flat leaves (every argument is a plain
    dense tensor, so there is no tree to walk)."""
    arg_leaves, kw_leaves = plan.__dict__["flat"]
    dtype = plan.dtype
    keys = list(kwargs)
    all_args: list[tuple[Any, ...]] = []
    all_kwargs: list[dict[str, Any]] = []
    for device, start, length in wave:
        move = _mover(device, dtype)
        plain = move if dtype is None else _mover(device, None)
        all_args.append(
            tuple(
                _cut(leaf, a, start, length, move, plain)
                for leaf, a in zip(arg_leaves, inputs, strict=True)
            )
        )
        all_kwargs.append(
            {
                k: _cut(leaf, kwargs[k], start, length, move, plain)
                for leaf, k in zip(kw_leaves, keys, strict=True)
            }
        )
    return all_args, all_kwargs


def _cut(
    leaf: tuple[Any, ...], t: _Tensor, start: int, length: int, move: Any, plain: Any
) -> _Tensor:
    """One leaf's part of a chunk, as ``scatter._run`` makes it for its node."""
    split, a, cast, _ = leaf
    if split:
        if start or length != t.shape[a]:  # the whole batch needs no narrow
            t = t.narrow(a, start, length)
    elif not a:  # a broadcast that stays where it is
        return t
    return (move if cast else plain)(t)


def _moves_nothing(plan: Plan, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether the plan's scatter returns the arguments themselves: one chunk, the whole batch,
    no cast, every tensor already on that chunk's device (true of every call that shares the
    signature, which holds each tensor's device, shape and dtype)."""
    if len(plan.slices) != 1 or len(plan.slices[0]) != 1 or plan.dtype is not None:
        return False
    device, start, length = plan.slices[0][0]
    if start != 0 or length != plan.batch_size:
        return False
    args, kw = take(plan, start, length, device)
    return (
        type(args) is tuple
        and len(args) == len(inputs)
        and all(a is b for a, b in zip(args, inputs, strict=True))
        and kw.keys() == kwargs.keys()
        and all(kw[k] is kwargs[k] for k in kw)
    )


def _instantiate(
    template: Plan,
    arg_leaves: list[tuple[Any, ...]],
    kw_leaves: list[tuple[Any, ...]],
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Plan:
    plan = Plan.__new__(Plan)
    plan.__dict__.update(template.__dict__)
    plan.root_args = StructNode(
        "tuple",
        inputs,
        list(range(len(inputs))),
        [_node(leaf, a) for leaf, a in zip(arg_leaves, inputs, strict=True)],
    )
    keys = list(kwargs)
    plan.root_kwargs = StructNode(
        "mapping",
        dict(kwargs),
        keys,
        [_node(leaf, kwargs[k]) for leaf, k in zip(kw_leaves, keys, strict=True)],
    )
    return plan
