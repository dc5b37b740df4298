"""Pass 1 of the batch rules: read the arguments, collect the votes, decide the batch size.

:class:`Collector` walks the positional and keyword arguments once, classifies every position
(a tensor or ndarray, a tensor list, a sequence, a marker, a ``PackedSequence``, a container or
another value) and records, in order, the votes for the batch size that its sizes and lengths
cast; :func:`decide_batch_size` then picks ``B``: the ``batch_size=`` option, else the first
``dp.Split``, else the vote. What pass 1 learned about each position (:class:`Info`) is what the
leaf rules (``plan._rules``) compile. Scatter's plan cache reads lists as pass 1 does
(:func:`list_kind`). The rules are the guide's "The batch rules, in short".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from dataparallel._common.checks import check_layout, check_mapping, too_deep
from dataparallel._common.describe import describe
from dataparallel._common.kinds import (
    ATOMS,
    MAPPING,
    container_kind,
    item_types,
    path_key,
    struct_items,
)
from dataparallel._common.packed import is_packed, sequence_count
from dataparallel._common.tree import MAX_DEPTH, TooDeep, leaves
from dataparallel.markers import Shared, Split
from dataparallel.plan._chunks import as_int
from dataparallel.plan._program import Vote

__all__ = ["Collector", "Info", "decide_batch_size", "is_array", "list_kind"]


class Info:
    """What pass 1 learned about one position; pass 2 turns it into a compiled node."""

    __slots__ = ("children", "common", "keys", "kind", "obj", "path", "size", "types")

    def __init__(self, kind: str, obj: Any, path: str) -> None:
        self.kind = kind
        self.obj = obj
        self.path = path
        self.size: int | None = None
        self.common: int | None = None
        self.keys: list[Any] = []
        self.children: list[Info] = []
        self.types: set[type] | None = None  # a list's item types, read once for both passes


def is_array(obj: Any) -> bool:
    """True for a tensor or an ndarray: what ``dp.Split`` cuts along a dimension."""
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


class Collector:
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

    def visit(self, obj: Any, path: str) -> Info:
        dim = self.dim
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            if isinstance(obj, torch.Tensor) and (obj.layout is not torch.strided or obj.is_nested):
                check_layout(obj, path)
            info = Info("array", obj, path)
            if obj.ndim > self.max_ndim:
                self.max_ndim = obj.ndim
            info.size = _size_along(obj, dim)
            if info.size is not None:
                self.votes.append(Vote(path, info.size, f"size along {self.axis}"))
            return info
        if isinstance(obj, Shared):
            self._check_depth(obj.obj, path, len(self.ancestors) + 1)  # scatter moves its tensors
            return Info("shared", obj, path)
        if isinstance(obj, Split):
            return self._visit_split(obj, path)
        if is_packed(obj):  # a namedtuple, but one batched input: its samples are sequences
            info = Info("packed", obj, path)
            self.packed = True
            info.size = sequence_count(obj)
            self.votes.append(Vote(path, info.size, "sequences of a PackedSequence"))
            return info
        if isinstance(obj, list) and obj:
            types = item_types(obj)
            kind = list_kind(obj, dim, types)
            if kind == "tensorlist":
                info = Info("tensorlist", obj, path)
                info.types = types
                info.common = _size_along(obj[0], dim)
                info.size = len(obj)
                self.votes.append(Vote(path, info.common or 0, f"common size along {self.axis}"))
                self.votes.append(Vote(path, info.size, "length"))
                return info
            if kind == "sequence":
                info = Info("sequence", obj, path)
                info.types = types
                info.size = len(obj)
                self.votes.append(Vote(path, info.size, "length"))
                self._check_items_depth(obj, types, path)
                return info
        container = container_kind(obj)
        if container is None:
            if isinstance(obj, Iterator):
                self.iterators.append(path)
            return Info("other", obj, path)
        info = Info(container, obj, path)
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

    def _check_items_depth(self, obj: list[Any], types: set[type], path: str) -> None:
        """A sequence's items do not vote, so they are not visited, but scatter walks them to
        move the tensors inside (per-sample or broadcast): hold them to the nesting rule of
        the visit, counted from the argument, so that ``dp.plan`` refuses what ``scatter`` and
        the wrapper would (one rule for all three). Items that are tensors, ndarrays, names or
        numbers hold nothing to walk."""
        if types <= ATOMS or all(issubclass(t, (torch.Tensor, np.ndarray)) for t in types):
            return
        # leaves() refuses a container at its depth above MAX_DEPTH, the visit one with
        # MAX_DEPTH ancestors: an item has this list and its ancestors above it.
        depth = len(self.ancestors) + 2
        for item in obj:
            self._check_depth(item, path, depth)  # (the sequence's path, as scatter names it)

    @staticmethod
    def _check_depth(obj: Any, path: str, depth: int) -> None:
        """Refuse containers in ``obj`` (at ``depth``, as ``leaves`` counts) nested more than
        ``MAX_DEPTH`` levels from the argument, or a cycle, as scatter's walk would."""
        try:
            for _ in leaves(obj, _depth=depth):
                pass
        except TooDeep:
            raise TooDeep(path) from None

    def _visit_split(self, marker: Split[Any], path: str) -> Info:
        inner = marker.obj
        info = Info("split", marker, path)
        if is_array(inner):
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


def decide_batch_size(
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
