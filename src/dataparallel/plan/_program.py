"""What a plan is: its readable record (``Plan``, ``Entry``, ``Vote``) and its compiled nodes.

``dataparallel.plan`` decides and fills these in; ``dataparallel.scatter`` executes the nodes
for any slice of the batch; ``str(plan)`` is the table that ``explain`` prints. Keeping the
data apart from the rules lets each module stay about one thing.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from dataparallel._movable import contains_record
from dataparallel._tree import container_kind, contains_array, describe, struct_items
from dataparallel.markers import Shared, Split

# Exact types that hold no tensor or ndarray: per-item checks skip them (a fast path only;
# subclasses take the full walk).
_ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})

__all__ = [
    "BroadcastNode",
    "Entry",
    "Node",
    "PackedNode",
    "PerSampleNode",
    "Plan",
    "SplitNode",
    "StructNode",
    "Vote",
    "format_plan",
]


@dataclass(frozen=True)
class Entry:
    """The rule one leaf follows: ``path`` such as ``"args[1]['boxes']"``, ``rule``, ``why``.

    ``what`` describes the leaf as passed; ``to`` says where its tensors go (``"cpu"``,
    ``"cuda:0/cuda:1"``: one device per chunk, in order) or that nothing moves; ``receives``
    is what each device gets, after the cast (``"Tensor[2/6/4/4, 8] float16"``: one size per
    chunk, in the order of ``to``; per-sample leaves name the items of each chunk).
    """

    path: str
    rule: str
    why: str
    what: str = ""
    to: str = ""
    receives: str = ""


@dataclass(frozen=True)
class Vote:
    """One vote for the batch size: who (``path``), for which ``size``, and as what."""

    path: str
    size: int
    source: str


# ----------------------------------------------------------------------------------------------
# Compiled nodes, executed by dataparallel.scatter for a slice [start, start + length).


class Node:
    """A compiled step of the plan."""

    __slots__ = ()


class SplitNode(Node):
    """A tensor or ndarray cut along ``dim``."""

    __slots__ = ("cast", "dim", "obj")

    def __init__(self, obj: Any, dim: int, cast: bool) -> None:
        self.obj, self.dim, self.cast = obj, dim, cast


class PerSampleNode(Node):
    """A sequence cut by items; tensors among the items are moved (and cast)."""

    __slots__ = ("cast", "holds_arrays", "obj", "path")

    def __init__(self, obj: Any, cast: bool) -> None:
        self.obj, self.cast = obj, cast
        self.path = "input"  # the argument path, for errors raised while executing the node
        # Names, ids, numbers: one C-speed look at the item types settles it.
        self.holds_arrays = not set(map(type, obj)) <= _ATOMS and any(
            contains_array(item) or contains_record(item) for item in obj
        )


class BroadcastNode(Node):
    """A value given whole to every device; tensors inside are moved (cast unless shared)."""

    __slots__ = ("cast", "moves", "obj", "path")

    def __init__(self, obj: Any, cast: bool) -> None:
        self.obj, self.cast = obj, cast
        self.moves = contains_array(obj)
        self.path = "input"  # the argument path, for errors raised while executing the node


class StructNode(Node):
    """A container rebuilt with its own type from its children's results."""

    __slots__ = ("children", "keys", "kind", "template")

    def __init__(self, kind: str, template: Any, keys: list[Any], children: list[Node]) -> None:
        self.kind, self.template, self.keys, self.children = kind, template, keys, children


class PackedNode(Node):
    """A compiled plan step: a ``PackedSequence`` split by sequence.

    Holds the input unpacked (batch first, sequences in their original order) and the lengths
    on the CPU, so each chunk is a slice and one ``pack_padded_sequence``.
    """

    __slots__ = ("lengths", "padded")

    def __init__(self, packed: PackedSequence) -> None:
        self.padded, self.lengths = pad_packed_sequence(packed, batch_first=True)


# ----------------------------------------------------------------------------------------------
# The plan.


@dataclass(eq=False)
class Plan:
    """How one call's arguments are split over devices. Made by ``plan``; runs nothing.

    Attributes:
        batch_size: ``B``, the number of samples in the call.
        devices: the devices used, one per chunk (a device whose chunk is empty is not used).
        chunk_sizes: the samples each used device processes, summed over waves.
        entries: one per leaf, with its path, rule and reason.
        votes: every vote for the batch size, in order.
        waves: the chunk sizes of each wave (one wave unless ``max_size`` forces more).
        decided_by: how ``B`` was decided (``batch_size=``, a ``dp.Split``, a vote).
        warnings: the messages a call with this plan warns with (inputs broadcast because
            their size is not ``B``).
    """

    batch_size: int
    devices: list[torch.device]
    chunk_sizes: list[int]
    entry_records: list[tuple[str, str, str, Any]]
    votes: list[Vote]
    waves: list[list[int]]
    decided_by: str
    dim: int
    warnings: list[str] = field(default_factory=list)
    dtype: torch.dtype | None = None
    # Compiled tree, and how to cut: each wave is a list of (device, start, length).
    root_args: Node | None = field(default=None, repr=False)
    root_kwargs: StructNode | None = field(default=None, repr=False)
    args_is_tuple: bool = field(default=True, repr=False)
    slices: list[list[tuple[torch.device, int, int]]] = field(default_factory=list, repr=False)
    # Each wave's sizes over every device given, 0 for an unused one (shard's rank sizes).
    device_sizes: list[list[int]] = field(default_factory=list, repr=False)
    warning_key: tuple[str, ...] = field(default=(), repr=False)

    @property
    def entries(self) -> list[Entry]:
        """One ``Entry`` per leaf, formatted on first use (the hot path never reads them)."""
        cached: list[Entry] | None = self.__dict__.get("_entries")
        if cached is None:
            chunks = [chunk for wave in self.slices for chunk in wave]
            cached = [
                Entry(path, rule, why, describe_leaf(value), *_receives(self, rule, value, chunks))
                for path, rule, why, value in self.entry_records
            ]
            self.__dict__["_entries"] = cached
        return cached

    def __str__(self) -> str:
        return format_plan(self)


def describe_leaf(obj: Any) -> str:
    """``describe(obj)``, with the item types of a long list or tuple found at C speed."""
    if type(obj) in (list, tuple) and len(obj) > 8:
        names = {
            "Tensor" if issubclass(t, torch.Tensor) else t.__name__ for t in set(map(type, obj))
        }
        return f"{type(obj).__name__}[{len(obj)}] of {'/'.join(sorted(names))}"
    return describe(obj)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _joined(parts: list[str]) -> str:
    """``"5"`` when every chunk has the same value, else one per chunk: ``"2/6/4/4"``."""
    return parts[0] if len(set(parts)) == 1 else "/".join(parts)


def _tensors_in(obj: Any) -> tuple[bool, bool]:
    """Whether ``obj`` holds a tensor, and a floating-point one, outside ``dp.Shared``."""
    if isinstance(obj, torch.Tensor):
        return True, obj.is_floating_point()
    if isinstance(obj, Shared):
        return _tensors_in(obj.obj)[0], False
    if isinstance(obj, Split):
        return _tensors_in(obj.obj)
    if type(obj) in _ATOMS or isinstance(obj, (str, bytes, np.ndarray)):
        return False, False
    kind = container_kind(obj)
    if kind is None:
        return False, False
    found = floating = False
    for value in struct_items(obj, kind)[1]:
        has, has_float = _tensors_in(value)
        found, floating = found or has, floating or has_float
        if floating:
            break
    return found, floating


def _receives(
    p: Plan, rule: str, value: Any, chunks: list[tuple[torch.device, int, int]]
) -> tuple[str, str]:
    """``(to, receives)`` of one leaf: where its tensors go and what each device gets."""
    if not chunks:
        return "", ""
    devices = _joined([str(device) for device, _, _ in chunks])
    cast = p.dtype is not None and not isinstance(value, Shared)
    inner = value.obj if isinstance(value, (Shared, Split)) else value
    if rule == "split":
        dim = p.dim
        if isinstance(value, Split) and value.dim is not None:
            dim = value.dim
        if isinstance(inner, PackedSequence):  # split by sequence, re-packed on each device
            dtype = inner.data.dtype
            if cast and dtype.is_floating_point and p.dtype is not None:
                dtype = p.dtype
            counts = _joined([str(length) for _, _, length in chunks])
            return devices, f"PackedSequence of {counts} sequences, {_dtype_name(dtype)}"
        shape = [str(n) for n in inner.shape]
        shape[dim] = _joined([str(length) for _, _, length in chunks])
        if isinstance(inner, torch.Tensor):
            dtype = inner.dtype
            if cast and dtype.is_floating_point and p.dtype is not None:
                dtype = p.dtype
            return devices, f"Tensor[{', '.join(shape)}] {_dtype_name(dtype)}"
        return "not moved (ndarray)", f"ndarray[{', '.join(shape)}] {inner.dtype}"
    if rule == "per-sample":
        ranges = _joined(
            [
                str(start) if length == 1 else f"{start}-{start + length - 1}"
                for _, start, length in chunks
            ]
        )
        lengths = _joined([str(length) for _, _, length in chunks])
        kinds = describe_leaf(inner).partition(" of ")[2]
        text = f"{type(inner).__name__}[{lengths}] of {kinds}: items {ranges}"
        has, has_float = _tensors_in(inner)
        if not has:
            return "not moved (no tensor)", text
        if cast and p.dtype is not None and has_float:
            text += f", float tensors cast to {_dtype_name(p.dtype)}"
        return devices, text
    # broadcast: one whole copy per device
    if isinstance(inner, torch.Tensor):
        dtype = inner.dtype
        if cast and dtype.is_floating_point and p.dtype is not None:
            dtype = p.dtype
        dims = ", ".join(str(n) for n in inner.shape)
        text = f"the whole Tensor[{dims}] {_dtype_name(dtype)}"
        if isinstance(value, Shared) and p.dtype is not None and dtype.is_floating_point:
            text += " (dp.Shared: not cast)"
        return devices, text
    if isinstance(inner, np.ndarray):
        return "not moved (ndarray)", "the same ndarray"
    has, has_float = _tensors_in(inner)
    if has:
        text = f"the whole {describe_leaf(inner)}, tensors moved"
        if cast and p.dtype is not None and has_float:
            text += f", float ones cast to {_dtype_name(p.dtype)}"
        return devices, text
    return "not moved (no tensor)", "the same object"


def format_plan(p: Plan) -> str:
    """A readable table of a plan: batch size and votes, devices and chunks, one row per leaf,
    then what each device receives (after the cast, with the devices it moves to)."""
    if not p.entries:
        device = p.devices[0] if p.devices else "its device"
        return (
            f"nothing to split: the call passes no input (or only empty containers); the "
            f"module runs once, on {device}, as it would without DataParallel"
        )
    lines = [f"batch size {p.batch_size}, decided by {p.decided_by}"]
    if p.batch_size == 0:
        device = p.devices[0] if p.devices else "the first device"
        lines.append(
            f"an empty batch: the module runs once, on {device} (replica 0, on the caller's "
            f"thread), with the empty inputs, and its output is returned as it is, as without "
            f"DataParallel"
        )
    if p.votes:
        tally: dict[int, list[str]] = {}
        for vote in p.votes:
            tally.setdefault(vote.size, []).append(f"{vote.path} ({vote.source})")
        for size, voters in tally.items():
            lines.append(f"  {len(voters)} vote(s) for {size}: {', '.join(voters)}")
    names = ", ".join(str(d) for d in p.devices)
    lines.append(f"devices used ({len(p.devices)}): {names}")
    if len(p.waves) == 1:
        lines.append(f"chunk sizes: {p.waves[0]}")
    else:
        lines.append(f"waves ({len(p.waves)}): {p.waves}")
    rows = [("path", "what", "rule", "why")] + [(e.path, e.what, e.rule, e.why) for e in p.entries]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        lines.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    lines.append("each device receives (sizes and items one per chunk, in device order):")
    received = [("path", "moved to", "receives")] + [(e.path, e.to, e.receives) for e in p.entries]
    widths = [max(len(r[i]) for r in received) for i in range(2)]
    for path, to, receives in received:
        lines.append(f"  {path:<{widths[0]}}  {to:<{widths[1]}}  {receives}")
    lines.extend(
        textwrap.fill(
            w,
            width=100,
            initial_indent="warning: ",
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for w in p.warnings
    )
    return "\n".join(lines)
