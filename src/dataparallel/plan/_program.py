"""What a plan is: its readable record (``Plan``, ``Entry``, ``Vote``) and its program.

``plan._build`` fills these in with what ``plan._votes`` and ``plan._rules`` decide;
``dataparallel.scatter`` runs the program for any slice of the batch; ``plan._explain`` words it
for ``explain``. Keeping the data apart from the rules and from the runner lets each module
stay about one thing.

A program is a tree of steps shaped like the call's arguments: a ``Rebuild`` step takes a
container apart and builds it again, with its own type, from its children's results; a leaf is
a cut (``SplitCut``, ``PerSampleCut``, ``BroadcastCut``, ``PackedCut``). A program holds no
argument, only what to do with one, so the same program serves every call whose signature is
the same (``scatter._plans``), run against that call's arguments. A program marked ``identity``
(one chunk, the whole batch, every tensor already on its device, no cast) gives back the
arguments themselves: the one-device call is a program too, not a branch of the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dataparallel.plan._explain import format_plan, row_text

__all__ = [
    "BroadcastCut",
    "Cut",
    "Entry",
    "PackedCut",
    "PerSampleCut",
    "Plan",
    "Program",
    "Rebuild",
    "SplitCut",
    "Step",
    "Vote",
]


@dataclass(frozen=True)
class Entry:
    """The rule one leaf follows: ``path`` such as ``"args[1]['boxes']"``, ``rule``, ``why``.

    ``what`` describes the leaf as passed; ``to`` says where its tensors go (``"cpu"``,
    ``"cuda:0/cuda:1"``: one device per chunk, in order) or that nothing moves; ``receives``
    is what each device gets, after the cast (``"Tensor[2/6/4/4, 8] float16"``: one size per
    chunk, in the order of ``to``; per-sample leaves name the items of each chunk).
    A record a ``Plan`` makes (``plan.entries``), not one to build.

    Example:
        >>> import torch, dataparallel as dp
        >>> entry = dp.plan((torch.zeros(6, 2),), None, ["cpu", "cpu"]).entries[0]
        >>> entry.path, entry.rule, entry.to, entry.receives
        ('args[0]', 'split', 'cpu', 'Tensor[3, 2] float32')
    """

    path: str
    rule: str
    why: str
    what: str = ""
    to: str = ""
    receives: str = ""


@dataclass(frozen=True)
class Vote:
    """One vote for the batch size: who (``path``), for which ``size``, and as what.

    A record a ``Plan`` makes (``plan.votes``, in argument order), not one to build.

    Example:
        >>> import torch, dataparallel as dp
        >>> votes = dp.plan((torch.zeros(6, 2), [1, 2, 3, 4, 5, 6]), None, ["cpu", "cpu"]).votes
        >>> [(v.path, v.size, v.source) for v in votes]
        [('args[0]', 6, 'size along dim 0'), ('args[1]', 6, 'length')]
    """

    path: str
    size: int
    source: str


# ----------------------------------------------------------------------------------------------
# Steps: what to do with one position of the arguments, for a slice [start, start + length).


class Step:
    """One step of a program. ``path`` names its position, for errors raised while running."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path


class Cut(Step):
    """A leaf step: what one argument's value becomes for a slice. ``cast``: floating-point
    tensors are cast to the plan's ``dtype``; ``unwrap``: the value is a marker (``dp.Split``,
    ``dp.Shared``) whose inside is cut."""

    __slots__ = ("cast", "unwrap")

    def __init__(self, path: str, cast: bool = False, unwrap: bool = False) -> None:
        super().__init__(path)
        self.cast, self.unwrap = cast, unwrap


class SplitCut(Cut):
    """A tensor or ndarray cut along ``dim``."""

    __slots__ = ("dim",)

    def __init__(self, path: str, dim: int, cast: bool, unwrap: bool = False) -> None:
        super().__init__(path, cast, unwrap)
        self.dim = dim


class PerSampleCut(Cut):
    """A sequence cut by items; tensors among the items are moved (and cast).

    ``holds_arrays``: ``False`` when the item types alone say no item holds a tensor (names,
    ids, numbers), ``True`` when they say every item is one, ``None`` when each run looks.
    """

    __slots__ = ("holds_arrays",)

    def __init__(
        self, path: str, cast: bool, holds_arrays: bool | None, unwrap: bool = False
    ) -> None:
        super().__init__(path, cast, unwrap)
        self.holds_arrays = holds_arrays


class BroadcastCut(Cut):
    """A value given whole to every device; tensors inside are moved (cast when ``cast``).

    ``unwrap``: the value is a ``dp.Shared``, whose inside is given (moved, never cast).
    ``moves``: whether tensors may lie inside (``None``: each run looks).
    """

    __slots__ = ("moves",)

    def __init__(self, path: str, cast: bool, moves: bool | None, unwrap: bool = False) -> None:
        super().__init__(path, cast, unwrap)
        self.moves = moves


class PackedCut(Cut):
    """A ``PackedSequence`` split by sequence and packed again on each device."""

    __slots__ = ()


class Rebuild(Step):
    """A container taken apart (its ``kind`` of ``dataparallel._common.kinds``) and rebuilt, with
    its own type and attributes, from its children's results."""

    __slots__ = ("children", "kind")

    def __init__(self, path: str, kind: Any, children: list[Step]) -> None:
        super().__init__(path)
        self.kind, self.children = kind, children


class Program:
    """The steps of a whole call: one for the positional arguments (a ``Rebuild`` of the tuple,
    or the one argument's step), one per keyword argument, in order.

    ``identity``: running the program gives back the arguments themselves (set by
    ``scatter._plans`` for a one-chunk plan that moves nothing).
    """

    __slots__ = ("args", "args_is_tuple", "identity", "kw_keys", "kw_steps")

    def __init__(
        self, args: Step, args_is_tuple: bool, kw_keys: list[str], kw_steps: list[Step]
    ) -> None:
        self.args, self.args_is_tuple = args, args_is_tuple
        self.kw_keys, self.kw_steps = kw_keys, kw_steps
        self.identity = False


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
        notes: what ``explain`` adds beyond the split: about the call (``num_items_in_batch``
            shared between the replicas) and about the module (which BatchNorm layers are
            synchronised over the replicas and which act per chunk).

    Example:
        >>> import torch, dataparallel as dp
        >>> p = dp.plan((torch.zeros(7, 2),), None, ["cpu", "cpu"], max_size=2)
        >>> p.batch_size, p.chunk_sizes, p.waves, p.decided_by
        (7, [4, 3], [[2, 2], [2, 1]], 'vote (1 of 1)')
        >>> print(p)  # the readable table: the votes, then each argument's rule
        batch size 7, decided by vote (1 of 1)
        ...
    """

    batch_size: int
    devices: list[torch.device]
    chunk_sizes: list[int]
    # (path, rule, why, value) per leaf; None in a plan reused from the cache (see ``remake``)
    leaf_rules: list[tuple[str, str, str, Any]] | None
    votes: list[Vote]
    waves: list[list[int]]
    decided_by: str
    dim: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dtype: torch.dtype | None = None
    # What scatter runs, and the call's arguments it runs on.
    program: Program | None = field(default=None, repr=False)
    inputs: Any = field(default=None, repr=False)
    kwargs: Mapping[str, Any] | None = field(default=None, repr=False)
    # How to cut: each wave is a list of (device, start, length).
    slices: list[list[tuple[torch.device, int, int]]] = field(default_factory=list, repr=False)
    # Each wave's sizes over every device given, 0 for an unused one (shard's rank sizes).
    device_sizes: list[list[int]] = field(default_factory=list, repr=False)
    warning_key: tuple[str, ...] = field(default=(), repr=False)
    # A reused plan's way to its rows: ``remake(inputs, kwargs)`` plans the same call afresh,
    # only when they are read.
    remake: Callable[[Any, Mapping[str, Any]], Plan] | None = field(default=None, repr=False)
    # A kept plan's memo, shared by every plan bound from it (``bind`` copies the reference):
    # what a caller makes once per kept plan (``DataParallel``'s warm step). ``None`` in a plan
    # made for one call.
    memo: dict[str, Any] | None = field(default=None, repr=False)
    # Made for its call alone, never kept: a rule read values the cache's key does not hold.
    per_call: bool = field(default=False, repr=False)

    @property
    def entries(self) -> list[Entry]:
        """One ``Entry`` per leaf, formatted on first use (the hot path never reads them)."""
        cached: list[Entry] | None = self.__dict__.get("_entries")
        if cached is None:
            records = self.leaf_rules
            if records is None and self.remake is not None:
                records = self.remake(self.inputs, self.kwargs or {}).leaf_rules
            chunks = [chunk for wave in self.slices for chunk in wave]
            cached = [
                Entry(path, rule, why, *row_text(self, rule, value, chunks))
                for path, rule, why, value in records or []
            ]
            self.__dict__["_entries"] = cached
        return cached

    def bind(self, inputs: Any, kwargs: Mapping[str, Any]) -> Plan:
        """This plan for another call of the same signature: same decisions and program, the
        call's own arguments (a template made by ``template`` holds none)."""
        new = Plan.__new__(Plan)
        new.__dict__.update(self.__dict__)
        new.inputs, new.kwargs = inputs, kwargs
        return new

    def template(self, remake: Callable[[Any, Mapping[str, Any]], Plan]) -> Plan:
        """This plan without the call's arguments or rows: what a cache may keep between calls
        (it must not keep a batch alive). ``remake(inputs, kwargs)`` plans a call afresh, for
        the rows of a plan bound to it."""
        new = self.bind(None, None)  # type: ignore[arg-type]
        new.leaf_rules, new.remake, new.memo = None, remake, {}
        new.__dict__.pop("_entries", None)
        return new

    def __str__(self) -> str:
        return format_plan(self)
