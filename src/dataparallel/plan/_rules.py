"""The batch rules: decide how a call's arguments are split, before anything runs.

``plan`` walks the positional and keyword arguments once, collects the votes for the batch
size, decides ``B``, gives every leaf a rule (``split``, ``per-sample`` or ``broadcast``) with
the reason, and cuts ``B`` into chunk sizes (and waves under ``max_size``). The result is a
``Plan``: a readable record for ``explain`` and a compiled tree that ``dataparallel.scatter``
executes for any slice of the batch. The rules are docs/guide.md's ("The batch rules, in short").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dataparallel._common.checks import (
    check_batch_size_used,
    check_layout,
    check_mapping,
    dim_out_of_range,
    too_deep,
)
from dataparallel._common.describe import describe
from dataparallel._common.kinds import (
    ATOMS,
    LIST,
    MAPPING,
    TUPLE,
    container_kind,
    item_types,
    path_key,
    struct_items,
)
from dataparallel._common.movable import has_to
from dataparallel._common.packed import is_packed, sequence_count
from dataparallel._common.tree import MAX_DEPTH, TooDeep, contains_array
from dataparallel.devices import DeviceSpec, resolve_devices
from dataparallel.markers import Shared, Split
from dataparallel.plan._chunks import as_int, cut_batch
from dataparallel.plan._explain import voters_phrase, warning_text
from dataparallel.plan._program import (
    BroadcastCut,
    Entry,
    PackedCut,
    PerSampleCut,
    Plan,
    Program,
    Rebuild,
    SplitCut,
    Step,
    Vote,
)

__all__ = [
    "Entry",
    "Plan",
    "Vote",
    "build_plan",
    "check_options",
    "holds_arrays",
    "list_kind",
    "plan",
]

SPLIT = "split"
PER_SAMPLE = "per-sample"
BROADCAST = "broadcast"

# Exact types that hold no tensor or ndarray.

_OPTION_NAMES = ("batch_size", "chunk_sizes", "weights", "max_size", "dtype", "strict")


# ----------------------------------------------------------------------------------------------
# Pass 1: classify every node and collect the votes.


class _Info:
    """What pass 1 learned about one position; pass 2 turns it into a compiled node."""

    __slots__ = ("children", "common", "keys", "kind", "obj", "path", "size", "types")

    def __init__(self, kind: str, obj: Any, path: str) -> None:
        self.kind = kind
        self.obj = obj
        self.path = path
        self.size: int | None = None
        self.common: int | None = None
        self.keys: list[Any] = []
        self.children: list[_Info] = []
        self.types: set[type] | None = None  # a list's item types, read once for both passes


def _is_array(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, np.ndarray))


def _size_along(x: Any, dim: int) -> int | None:
    """``x``'s size along ``dim``, or ``None`` when it has no such dimension."""
    ndim = x.ndim
    if dim >= 0:
        return int(x.shape[dim]) if ndim > dim else None
    return int(x.shape[dim]) if ndim >= -dim else None


def _item_kind(x: Any) -> Any:
    """The kind of a list item, for telling sequences from structure."""
    if isinstance(x, torch.Tensor):
        return "tensor"
    if isinstance(x, np.ndarray):
        return "ndarray"
    if isinstance(x, (bool, np.bool_)):
        return "bool"
    if isinstance(x, (int, float, complex, np.number)):
        return "number"
    if isinstance(x, Mapping):
        return "mapping"
    return type(x)


def list_kind(obj: list[Any], dim: int, types: set[type] | None = None) -> str:
    """``tensorlist``, ``sequence`` or ``structure`` for a non-empty list (the guide's words:
    a tensor list, a sequence, or structure). ``types``: the set of its items' types, when the
    caller has it."""
    first = obj[0]
    # The kind of an item depends only on its type: one type, one kind (the common case,
    # checked at C speed); only a mix of types needs the item-by-item test.
    if types is None:
        types = item_types(obj)
    if isinstance(first, torch.Tensor):
        if len(types) > 1 and not all(isinstance(x, torch.Tensor) for x in obj):
            return "structure"
        # A tensor list needs one common size: stop at the first item that differs
        # (boxes of varying counts differ within the first few).
        common = _size_along(first, dim)
        if common is None:
            return "sequence"
        for x in obj:
            if _size_along(x, dim) != common:
                return "sequence"
        return "tensorlist"
    if len(types) == 1:
        return "sequence"
    kind = _item_kind(first)
    if all(_item_kind(x) == kind for x in obj):
        return "sequence"
    return "structure"


class _Collector:
    """Pass 1: walks the arguments, classifies positions and records votes in order."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.votes: list[Vote] = []
        self.first_split: tuple[str, int] | None = None
        self.iterators: list[str] = []  # paths of iterators, which replicas cannot share
        self.packed = False  # a PackedSequence needs the plan even on one device
        self.axis = f"dim {dim}"
        self.max_ndim = 0  # the most dimensions of any tensor or ndarray seen (dim's range)
        self.ancestors: list[int] = []  # ids of the containers on the current path (cycles)

    def visit(self, obj: Any, path: str) -> _Info:
        dim = self.dim
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            if isinstance(obj, torch.Tensor) and (obj.layout is not torch.strided or obj.is_nested):
                check_layout(obj, path)
            info = _Info("array", obj, path)
            if obj.ndim > self.max_ndim:
                self.max_ndim = obj.ndim
            info.size = _size_along(obj, dim)
            if info.size is not None:
                self.votes.append(Vote(path, info.size, f"size along {self.axis}"))
            return info
        if isinstance(obj, Shared):
            return _Info("shared", obj, path)
        if isinstance(obj, Split):
            return self._visit_split(obj, path)
        if is_packed(obj):  # a namedtuple, but one batched input: its samples are sequences
            info = _Info("packed", obj, path)
            self.packed = True
            info.size = sequence_count(obj)
            self.votes.append(Vote(path, info.size, "sequences of a PackedSequence"))
            return info
        if isinstance(obj, list) and obj:
            types = item_types(obj)
            kind = list_kind(obj, dim, types)
            if kind == "tensorlist":
                info = _Info("tensorlist", obj, path)
                info.types = types
                info.common = _size_along(obj[0], dim)
                info.size = len(obj)
                self.votes.append(Vote(path, info.common or 0, f"common size along {self.axis}"))
                self.votes.append(Vote(path, info.size, "length"))
                return info
            if kind == "sequence":
                info = _Info("sequence", obj, path)
                info.types = types
                info.size = len(obj)
                self.votes.append(Vote(path, info.size, "length"))
                return info
        container = container_kind(obj)
        if container is None:
            if isinstance(obj, Iterator):
                self.iterators.append(path)
            return _Info("other", obj, path)
        info = _Info(container, obj, path)
        info.keys, values = struct_items(obj, container)
        if container == MAPPING and not isinstance(obj, dict):
            check_mapping(obj, path, info.keys, values)
        ancestors = self.ancestors
        if len(ancestors) >= MAX_DEPTH or id(obj) in ancestors:
            too_deep(obj, path, ancestors)
        ancestors.append(id(obj))
        info.children = [
            self.visit(v, path + path_key(container, k))
            for k, v in zip(info.keys, values, strict=True)
        ]
        ancestors.pop()
        return info

    def _visit_split(self, marker: Split[Any], path: str) -> _Info:
        inner = marker.obj
        info = _Info("split", marker, path)
        if _is_array(inner):
            dim = self.dim if marker.dim is None else marker.dim
            info.size = _size_along(inner, dim)
            if info.size is None:
                raise ValueError(
                    f"{path}: dp.Split of {describe(inner)} along dim {dim}, which it does not "
                    f"have; expected a dim below {inner.ndim}: pass dp.Split(x, dim=...)"
                )
        elif isinstance(inner, (list, tuple)):
            info.size = len(inner)
        else:
            raise TypeError(
                f"{path}: dp.Split expected a tensor, an ndarray, a list or a tuple, got "
                f"{describe(inner)}; wrap only batched inputs in dp.Split"
            )
        if self.first_split is None:
            self.first_split = (path, info.size)
        return info


def _decide_batch_size(
    votes: list[Vote], first_split: tuple[str, int] | None, batch_size: int | None
) -> tuple[int, str, list[int]]:
    """``B`` and a phrase saying how it was decided: option, first ``dp.Split``, or vote."""
    if batch_size is not None:
        batch_size = as_int(batch_size)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size: expected an int >= 1 (the number of samples in the call), got "
                f"{batch_size!r}; pass None to let the inputs vote"
            )
        return batch_size, "batch_size=", []
    if first_split is not None:
        return first_split[1], f"dp.Split at {first_split[0]}", []
    if not votes:
        return 1, "default (no input has a batch dimension)", []
    first = votes[0].size
    if all(vote.size == first for vote in votes):  # the common case: every vote agrees
        return first, f"vote ({len(votes)} of {len(votes)})", []
    counts: dict[int, int] = {}
    for vote in votes:
        counts[vote.size] = counts.get(vote.size, 0) + 1
    top = max(counts.values())
    # dicts keep insertion order, so the first size reaching the top count is the earliest vote
    winner = next(size for size, n in counts.items() if n == top)
    tied = [size for size, n in counts.items() if n == top]
    how = f"vote ({top} of {len(votes)})"
    if len(tied) > 1:
        how += f", tie with {tied[1:]} broken by the earliest vote"
    return winner, how, tied[1:]


# ----------------------------------------------------------------------------------------------
# Pass 2: with B known, give every leaf its rule.


class _Compiler:
    def __init__(
        self,
        batch: int,
        dim: int,
        voters: Callable[[], str],
        strict: bool,
        cast: bool,
        lost_ties: list[int],
    ) -> None:
        self.batch, self.dim, self.strict, self.cast = batch, dim, strict, cast
        self.lost_ties, self._voters = lost_ties, voters
        # (path, rule, why, value): formatted into Entry objects only when someone reads them
        self.entries: list[tuple[str, str, str, Any]] = []
        self.mismatched: list[tuple[str, str]] = []  # (path, what was found)
        self.notes: list[str] = []

    def entry(self, info: _Info, rule: str, why: str) -> None:
        self.entries.append((info.path, rule, why, info.obj))

    @property
    def voters(self) -> str:
        """Who set the batch size, as a phrase for messages (built only when one is needed)."""
        return self._voters()

    def mismatch(self, path: str, found: str) -> None:
        if self.strict:
            raise ValueError(
                f"{path}: {found}, expected the batch size {self.batch} ({self.voters}) "
                f"(strict=True); mark it dp.Shared(...) if it is not batched, or pass "
                f"batch_size=/dp.Split(...) if the batch size is wrong"
            )
        self.mismatched.append((path, found))

    def compile(self, info: _Info) -> Step:
        try:
            return self._compile(info)
        except TooDeep as exc:  # from a walk inside a leaf (a sequence, a broadcast object)
            if exc.path is None:
                raise TooDeep(info.path) from None
            raise

    def _compile(self, info: _Info) -> Step:
        kind = info.kind
        if kind == "array":
            return self._array(info)
        if kind == "tensorlist":
            return self._tensorlist(info)
        if kind == "sequence":
            return self._sequence(info)
        if kind == "split":
            return self._split(info)
        if kind == "packed":
            return self._packed(info)
        if kind == "shared":
            self.entry(info, BROADCAST, "marked dp.Shared")
            return BroadcastCut(info.path, cast=False, moves=None, unwrap=True)
        if kind == "other":
            self.entry(info, BROADCAST, "not batched (no tensor, ndarray or sequence)")
            return BroadcastCut(info.path, cast=self.cast, moves=False)
        # containers (an empty list is structure too)
        return Rebuild(info.path, kind, [self.compile(c) for c in info.children])

    def _array(self, info: _Info) -> Step:
        b, size = self.batch, info.size
        if size is None:
            why = "0-dim" if info.obj.ndim == 0 else f"no dim {self.dim}"
            self.entry(info, BROADCAST, f"{why}: not batched")
            return BroadcastCut(info.path, cast=self.cast, moves=True)
        if size == b:
            self.entry(info, SPLIT, f"size {size} along dim {self.dim} is the batch size")
            return SplitCut(info.path, self.dim, self.cast)
        self.mismatch(info.path, f"size {size} along dim {self.dim}")
        self.entry(info, BROADCAST, f"size {size} along dim {self.dim} is not the batch size {b}")
        return BroadcastCut(info.path, cast=self.cast, moves=True)

    def _tensorlist(self, info: _Info) -> Step:
        b, obj = self.batch, info.obj
        if info.common == b:
            if info.size in self.lost_ties:
                # torch's reading won only by the tie-break: say so, with the other reading's fix
                self.notes.append(
                    f"{info.path}: a list of {info.size} tensors was read as structure, each "
                    f"tensor split along dim {self.dim} (common size {b}, tied with its length "
                    f"{info.size} and first); if its items are samples, pass "
                    f"dp.Split({info.path})"
                )
            children: list[Step] = []
            why = f"item of a tensor list whose common size {b} is the batch size"
            for i, t in enumerate(obj):
                path = f"{info.path}[{i}]"
                self.entries.append((path, SPLIT, why, t))
                children.append(SplitCut(path, self.dim, self.cast))
            return Rebuild(info.path, LIST, children)
        if info.size == b:
            self.entry(info, PER_SAMPLE, f"a list of {b} tensors: its length is the batch size")
            return PerSampleCut(info.path, self.cast, holds_arrays(obj, info.types))
        # neither reading fits: each tensor follows the rules alone
        children = []
        for i, t in enumerate(obj):
            child = _Info("array", t, f"{info.path}[{i}]")
            child.size = info.common
            children.append(self._array(child))
        return Rebuild(info.path, LIST, children)

    def _sequence(self, info: _Info) -> Step:
        b, n = self.batch, info.size
        if n == b:
            why = f"a sequence of {n} items: its length is the batch size"
            if has_to(info.obj[0]):
                why += "; each item moved by its own .to(device)"
            self.entry(info, PER_SAMPLE, why)
            return PerSampleCut(info.path, self.cast, holds_arrays(info.obj, info.types))
        if contains_array(info.obj):
            self.mismatch(info.path, f"a list of {n} items holding tensors or ndarrays")
        self.entry(info, BROADCAST, f"a sequence of {n} items, not the batch size {b}")
        return BroadcastCut(info.path, cast=self.cast, moves=None)

    def _packed(self, info: _Info) -> Step:
        n = info.size
        if n == self.batch:
            self.entry(
                info,
                SPLIT,
                f"a PackedSequence of {n} sequences: split by sequence, re-packed on each device",
            )
            return PackedCut(info.path)
        self.mismatch(info.path, f"a PackedSequence of {n} sequences")
        self.entry(info, BROADCAST, f"{n} sequences, not the batch size {self.batch}")
        return BroadcastCut(info.path, cast=False, moves=True)

    def _split(self, info: _Info) -> Step:
        marker, b = info.obj, self.batch
        if info.size != b:
            raise ValueError(
                f"{info.path}: dp.Split of {describe(marker.obj)} has size {info.size}, expected "
                f"the batch size {b} ({self.voters}); split only inputs of the batch size, or "
                f"pass batch_size=/chunk_sizes= that match it"
            )
        if _is_array(marker.obj):
            dim = self.dim if marker.dim is None else marker.dim
            self.entry(info, SPLIT, f"marked dp.Split (dim {dim})")
            return SplitCut(info.path, dim, self.cast, unwrap=True)
        self.entry(info, PER_SAMPLE, "marked dp.Split: split by items")
        return PerSampleCut(info.path, self.cast, holds_arrays(marker.obj), unwrap=True)


def holds_arrays(items: Any, types: set[type] | None = None) -> bool | None:
    """What the item types of a per-sample sequence say about tensors inside its items:
    ``False`` for names, ids and numbers, ``True`` for tensors and ndarrays, ``None`` (each
    run looks) for anything else. Types only, so a reused plan's answer holds for any call
    whose items have the same types. ``types``: the set of the items' types, when the caller
    has it."""
    if types is None:
        types = item_types(items)
    if types <= ATOMS:
        return False
    if all(issubclass(t, (torch.Tensor, np.ndarray)) for t in types):
        return True
    return None


def check_options(opts: Mapping[str, Any]) -> None:
    unknown = sorted(set(opts) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unexpected option(s) {unknown}; expected some of {list(_OPTION_NAMES)}")


def build_plan(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: list[torch.device],
    dim: int = 0,
    *,
    allow_waves: bool = True,
    **options: Any,
) -> Plan:
    """``plan`` for already resolved devices: what the wrapper, ``scatter`` and ``shard`` call.

    ``options`` are ``plan``'s (``batch_size``, ``chunk_sizes``, ``weights``, ``max_size``,
    ``dtype``, ``strict``); ``allow_waves=False`` refuses a batch that ``max_size`` would cut
    into more than one round (``scatter`` returns one).
    """
    check_options(options)
    batch_size: int | None = options.get("batch_size")
    chunk_sizes: Sequence[int] | None = options.get("chunk_sizes")
    weights: Sequence[float] | None = options.get("weights")
    max_size: int | None = options.get("max_size")
    dtype: torch.dtype | None = options.get("dtype")
    strict: bool = bool(options.get("strict", False))
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs: expected a dict of keyword arguments, got {describe(kwargs)}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int (the batch dimension), got {dim!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype such as torch.float16, got {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(
            f"dtype: expected a floating-point dtype such as torch.float16 (it casts float "
            f"inputs; integer and boolean ones keep their type), got {dtype}; cast integer "
            f"inputs yourself before the call"
        )
    collector = _Collector(dim)
    is_tuple = type(inputs) is tuple
    if is_tuple:
        arg_infos = [collector.visit(a, f"args[{i}]") for i, a in enumerate(inputs)]
    else:
        arg_info = collector.visit(inputs, "input")
    kw_keys = list(kwargs.keys())
    kw_infos = [collector.visit(kwargs[k], f"kwargs[{k!r}]") for k in kw_keys]

    if not collector.votes and collector.max_ndim > 0 and collector.first_split is None:
        raise dim_out_of_range(dim, collector.max_ndim)
    batch, how, lost_ties = _decide_batch_size(collector.votes, collector.first_split, batch_size)

    def voters() -> str:
        return voters_phrase(batch, how, collector.votes)

    compiler = _Compiler(batch, dim, voters, strict, cast=dtype is not None, lost_ties=lost_ties)
    if is_tuple:
        root_args: Step = Rebuild("args", TUPLE, [compiler.compile(i) for i in arg_infos])
    else:
        root_args = compiler.compile(arg_info)
    program = Program(root_args, is_tuple, kw_keys, [compiler.compile(i) for i in kw_infos])

    if batch_size is not None and batch > 1 and compiler.entries:
        check_batch_size_used(batch, compiler.entries)
    if batch == 0:
        # An empty batch runs the module once, on the first device, as the plain module would
        # (torch's DataParallel does the same); there are no samples to cut, so the chunk
        # options do not apply.
        waves = [[0] * len(devices)]
    else:
        waves = cut_batch(
            batch,
            len(devices),
            chunk_sizes=chunk_sizes,
            weights=weights,
            max_size=max_size,
            allow_waves=allow_waves,
        )
    chunks = sum(1 for wave in waves for size in wave if size)
    if collector.iterators and chunks > 1:
        raise ValueError(
            f"{', '.join(collector.iterators)}: an iterator or generator, expected a value that "
            f"{chunks} chunks can share: the first replica to read it would consume it and the "
            f"others would see nothing; pass list(...) instead (split per sample when it has "
            f"the batch size, else broadcast)"
        )
    slices: list[list[tuple[torch.device, int, int]]] = []
    start = 0
    totals = [0] * len(devices)
    for wave in waves:
        cut = []
        for index, size in enumerate(wave):
            if size:
                cut.append((devices[index], start, size))
                start += size
                totals[index] += size
        slices.append(cut)
    used = [i for i, total in enumerate(totals) if total]
    if batch == 0:
        slices, used = [[(devices[0], 0, 0)]], [0]
    warnings = list(compiler.notes)
    if compiler.mismatched:
        warnings.insert(0, warning_text(batch, how, voters(), collector.votes, compiler.mismatched))
    return Plan(
        batch_size=batch,
        devices=[devices[i] for i in used],
        chunk_sizes=[totals[i] for i in used],
        leaf_rules=compiler.entries,
        votes=collector.votes,
        waves=[[s for s in wave if s] for wave in waves] if batch else [[0]],
        device_sizes=waves,
        decided_by=how,
        dim=dim,
        warnings=warnings,
        dtype=dtype,
        program=program,
        inputs=inputs,
        kwargs=kwargs,
        slices=slices,
        warning_key=tuple(path for path, _ in compiler.mismatched)
        + tuple(note.split(":", 1)[0] for note in compiler.notes),
    )


def plan(
    inputs: Any,
    kwargs: Mapping[str, Any] | None = None,
    devices: DeviceSpec | Sequence[DeviceSpec] | None = None,
    dim: int = 0,
    **opts: Any,
) -> Plan:
    """Decide how a call's arguments are split over ``devices``; runs nothing.

    Args:
        inputs: the positional arguments as a ``tuple``; anything else is one argument.
        kwargs: the keyword arguments (a dict), or ``None``.
        devices: a device list such as ``["cpu", "cpu"]`` or ``[0, 1]``; ``None`` means every
            visible CUDA device, else the CPU.
        dim: the batch dimension of tensors and ndarrays.
        **opts: ``batch_size``, ``chunk_sizes``, ``weights``, ``max_size``, ``dtype``,
            ``strict`` (see docs/guide.md, "The batch rules, in short").

    Returns:
        A ``Plan``; ``str(plan)`` is a readable table of the votes and of each leaf's rule.

    >>> import torch, dataparallel as dp
    >>> p = dp.plan((torch.zeros(10, 3), torch.zeros(1, 4)), None, ["cpu", "cpu"])
    >>> p.batch_size, p.chunk_sizes, [e.rule for e in p.entries]
    (10, [5, 5], ['split', 'broadcast'])
    """
    check_options(opts)
    return build_plan(inputs, kwargs, resolve_devices(devices), dim, **opts)
