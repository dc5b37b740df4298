"""What a plan is: its readable record (``Plan``, ``Entry``, ``Vote``) and its compiled nodes.

``dataparallel.plan`` decides and fills these in; ``dataparallel.scatter`` executes the nodes
for any slice of the batch; ``str(plan)`` is the table that ``explain`` prints. Keeping the
data apart from the rules lets each module stay about one thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dataparallel.records import contains_record
from dataparallel.tree import contains_array, describe

# Exact types that hold no tensor or ndarray: per-item checks skip them (a fast path only;
# subclasses take the full walk).
_ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})

__all__ = [
    "BroadcastNode",
    "Entry",
    "Node",
    "PerSampleNode",
    "Plan",
    "SplitNode",
    "StructNode",
    "Vote",
    "format_plan",
]


@dataclass(frozen=True)
class Entry:
    """The rule one leaf follows: ``path`` such as ``"args[1]['boxes']"``, ``rule``, ``why``."""

    path: str
    rule: str
    why: str
    what: str = ""


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
            cached = [
                Entry(path, rule, why, describe_leaf(value))
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


def format_plan(p: Plan) -> str:
    """A readable table of a plan: batch size and votes, devices and chunks, one row per leaf."""
    lines = [f"batch size {p.batch_size}, decided by {p.decided_by}"]
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
    if p.entries:
        rows = [("path", "what", "rule", "why")] + [
            (e.path, e.what, e.rule, e.why) for e in p.entries
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    else:
        lines.append("  (no leaves)")
    lines.extend(f"warning: {w}" for w in p.warnings)
    return "\n".join(lines)
