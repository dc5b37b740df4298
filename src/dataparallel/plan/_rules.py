"""Pass 2 of the batch rules: with the batch size known, give every leaf its rule.

:class:`Compiler` turns what pass 1 learned about each position (``plan._votes``) into a step
of the plan's program: a tensor or ndarray whose size along ``dim`` is the batch size is split
(so are a tensor list's items when their common size is), a list of that length is cut per
sample, a ``dp.Split`` or a ``PackedSequence`` as its own rule says, anything else is
broadcast; each with its reason, and a warning for inputs that look
batched but do not match. :func:`holds_arrays` tells the per-sample cut, from the item
types alone, whether to look inside the items; scatter's plan cache asks it too. The rules are
the guide's "The batch rules, in short".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dataparallel._common.describe import describe
from dataparallel._common.kinds import ATOMS, LIST, item_types
from dataparallel._common.movable import has_to
from dataparallel._common.tree import TooDeep, contains_array
from dataparallel.plan._program import (
    BroadcastCut,
    PackedCut,
    PerSampleCut,
    Rebuild,
    SplitCut,
    Step,
)
from dataparallel.plan._votes import Collector, Info, is_array

__all__ = ["Compiler", "holds_arrays"]

SPLIT = "split"
PER_SAMPLE = "per-sample"
BROADCAST = "broadcast"


class Compiler:
    """Pass 2: compiles each position into a step, recording its rule, the reason, and any
    input that looks batched but does not have the batch size (a warning, or an error under
    ``strict``)."""

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
        # A step read from values a cached plan's key does not hold (the tensors inside a
        # sequence read as a container): the plan is then made for its call alone.
        self.per_call = False

    def entry(self, info: Info, rule: str, why: str) -> None:
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

    def compile(self, info: Info) -> Step:
        try:
            return self._compile(info)
        except TooDeep as exc:  # from a walk inside a leaf (a sequence, a broadcast object)
            if exc.path is None:
                raise TooDeep(info.path) from None
            raise

    def _compile(self, info: Info) -> Step:
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

    def _array(self, info: Info) -> Step:
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

    def _tensorlist(self, info: Info) -> Step:
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
            child = Info("array", t, f"{info.path}[{i}]")
            child.size = info.common
            children.append(self._array(child))
        return Rebuild(info.path, LIST, children)

    def _sequence(self, info: Info) -> Step:
        b, n = self.batch, info.size
        if n == b:
            why = f"a sequence of {n} items: its length is the batch size"
            if has_to(info.obj[0]):
                why += "; each item moved by its own .to(device)"
            self.entry(info, PER_SAMPLE, why)
            return PerSampleCut(info.path, self.cast, holds_arrays(info.obj, info.types))
        if contains_array(info.obj):
            inside = self._container(info)
            if inside is not None:
                return inside
            self.mismatch(info.path, f"a list of {n} items holding tensors or ndarrays")
        self.entry(info, BROADCAST, f"a sequence of {n} items, not the batch size {b}")
        return BroadcastCut(info.path, cast=self.cast, moves=None)

    def _container(self, info: Info) -> Step | None:
        """A list whose length is not the batch size, every tensor or ndarray inside it with
        the batch size along ``dim`` (an RNN's per-layer hidden states ``[(h0, c0), (h1,
        c1)]``, batch on dim 1): structure, each tensor split inside, as torch's scatter does.
        ``None`` where anything inside votes for another size (then it is broadcast, with the
        mismatch warning)."""
        inner = Collector(self.dim)
        children = [inner.visit(item, f"{info.path}[{i}]") for i, item in enumerate(info.obj)]
        if not inner.votes or any(vote.size != self.batch for vote in inner.votes):
            return None
        self.per_call = True  # the key of a kept plan does not hold the shapes inside
        return Rebuild(info.path, LIST, [self.compile(child) for child in children])

    def _packed(self, info: Info) -> Step:
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

    def _split(self, info: Info) -> Step:
        marker, b = info.obj, self.batch
        if info.size != b:
            raise ValueError(
                f"{info.path}: dp.Split of {describe(marker.obj)} has size {info.size}, expected "
                f"the batch size {b} ({self.voters}); split only inputs of the batch size, or "
                f"pass batch_size=/chunk_sizes= that match it"
            )
        if is_array(marker.obj):
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
