"""Parameters written inside forward: one write per call, as on one device, or a refusal.

A momentum encoder updates its key encoder inside forward (MoCo: ``param_k.data =
param_k.data * m + param_q.data * (1 - m)``; BYOL: ``param_k.data.mul_(m).add_(...)``; timm's
``ModelEmaV2``: ``torch._foreach_lerp_``). Where the replicas share the module's parameters (a
list that repeats a device: ``["cpu", "cpu"]``, ``[0, 0]``, the copies of ``"cpu:1"`` shared by
two replicas there), every replica would write the same tensor: the number of updates per call
would be a race, and each replica would compute with whatever the others had written so far.
On one device, and with torch on separate GPUs, the update happens once, and every chunk is
computed with it.

A write is seen by mechanism, never by a change of value (an EMA's first update can keep every
value; a row rotation keeps the sum and norm), on every call:

- a shared parameter that does not require grad (a key encoder, an EMA teacher, a frozen
  backbone, a counter) is given to every replica after the first as a copy-on-write clone
  (``torch._lazy_clone``): it shares the module's memory until one of the two is written, by
  any route (in place, through ``.data``, ``_foreach_*``), and then the writer gets its own
  copy. So replica 0 (the module itself) writes the module's parameter once, the others write
  their own, and a frozen backbone that forward never writes costs no memory at all. Each
  pair is made with a third holder of the memory that no replica writes (an anchor), so no
  write during the call is the last one to it: torch gives the last writer the memory itself
  while a concurrent writer may still be copying it (a race in torch 2.13's copy-on-write
  that corrupts the heap: ``free(): unaligned chunk``), and every writer copies instead.
  The anchor is dropped after a call that wrote the pair. A clone
  is kept across calls: while both sides are unwritten as it is, else with its data rebound
  to a new clone of the module's value (``resync``). It is the same tensor object, so an
  earlier call's pending backward reads what a later call's forward wrote into it, as it
  reads the module's own tensor on one device (heykeetae's SAGAN: a spectral norm writes
  ``u.data`` on each of two calls, then one backward);
- a shared parameter that requires grad stays shared (the gradient must reach it), and its
  version counter and data address are read before and after the replicas run: a forward that
  wrote it (a max-norm renormalisation under ``torch.no_grad()``, a decay, a ``.data =``
  assignment) is refused at that call with the fix, since every replica wrote it, in a race.
  A write through ``.data`` in place bumps no version counter: that one is not seen.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch

from dataparallel._common.warn import warn_user
from dataparallel.replicate._buffer_writes import (
    BufferWrites,
    chunk_write,
    memory_of,
    tensor_names,
)

__all__ = ["WRITES", "ForwardWrites", "check_writes", "resync"]

# The mark on replica 1's ``__dict__`` that ``parallel_apply`` reads after the replicas ran.
WRITES = "_dataparallel_writes"

_IS_COW: Callable[[torch.Tensor], bool] = torch._C._is_cow_tensor  # type: ignore[attr-defined]
_LAZY_CLONE = torch._lazy_clone
_SET_VERSION: Callable[..., None] = torch._C._autograd._unsafe_set_version_counter
# The data address without the copy ``data_ptr`` makes of a copy-on-write tensor.
_PTR: Callable[[torch.Tensor], int] = torch.Tensor.const_data_ptr  # type: ignore[attr-defined]
_VERSION_OF = operator.attrgetter("_version")
# A clones entry: the tensor cloned, its clone, and their anchor (``_pair``).
Pair = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class ForwardWrites:
    """Which parameter tensors a replica set's replicas share, the copy-on-write clones that
    keep each replica's writes its own, and the trainable ones guarded during a call."""

    __slots__ = (
        "before",
        "buffers",
        "clones",
        "frozen",
        "frozen_marks",
        "guard",
        "head",
        "holders",
        "landed",
        "own",
        "params",
        "shared",
        "slots",
        "tensors",
    )

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params  # the replica set's parameters (a list fixed with the set)
        self.shared: list[int] | None = None  # slots shared by two replicas (read at 1st sync)
        # (replica, slot) -> (the tensor cloned, its clone, their anchor or None): kept while
        # neither was written
        self.clones: dict[tuple[int, int], Pair] = {}
        # This call's parameters that do not require grad where a replica after the first has
        # a tensor of its own (a clone, or a copy on its device): ``(slot, replica)``, then
        # their tensors (replica 0's for each, then the replica's) and those tensors' marks:
        # versions and data addresses, and which ones are copy-on-write.
        self.frozen: tuple[list[tuple[int, int]], list[torch.Tensor]] = ([], [])
        self.frozen_marks: tuple[list[int | None] | None, list[bool]] = (None, [])
        # ((replicas, each parameter's requires_grad), a getter of the frozen slots, the pairs)
        self.slots: tuple[tuple[int, list[bool]], Callable[[Any], Any], list[Any]] | None = None
        self.landed: set[int] = set()  # the slots whose landed write was said
        self.guard: list[torch.Tensor] = []  # shared tensors that require grad, this call
        # Their versions, then their data addresses, at the sync (``_marks``).
        self.before: list[int | None] = []
        # The parameters at the shared slots, read at the first sync (``arm``'s, for replicas
        # that use the parameters themselves: no copy on any device).
        self.tensors: list[torch.Tensor] = []
        # The replica set's ``Rebinding``, whose shared holders are read after the call (set
        # at each install; ``None``: none to read).
        self.holders: Any = None
        # The id of the set's replica 0 where it is a copy; ``None`` where it is the module
        # itself (which holds no ``WRITES``). A call that ran without it (a later wave under
        # ``max_size``) lands no write: its copies' writes are dropped.
        self.head: int | None = None
        # A weak reference to the replica set, told right after each call what its replicas
        # wrote on themselves (``Replicas.after_call``; ``None``: none to tell).
        self.own: Callable[[], Any] | None = None
        # The later replicas' private buffer copies, read for a write only one of them made.
        self.buffers = BufferWrites()

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        """Pickled or copied (``torch.save(replica)``) without the weak reference to the set,
        which cannot be."""
        state = {name: getattr(self, name) for name in self.__slots__ if hasattr(self, name)}
        state["own"] = None
        return None, state

    def arm(self) -> bool:
        """For replicas that share the parameters themselves (no copy on any device): guard
        the trainable shared ones for this call; whether some shared one needs clones (or the
        replicas hold clones of parameters that are trainable now: they get the parameters
        themselves again)."""
        tensors = self.tensors
        if not tensors:
            self.guard = []
            return False
        # (``requires_grad`` is read on every call: it changes without any write we could see)
        if all(map(_REQUIRES_GRAD, tensors)):
            self.guard = tensors
            try:
                self.before = [*map(_VERSION_OF, tensors), *map(_PTR, tensors)]
            except RuntimeError:
                self.before = _marks(tensors)
            return bool(self.clones)
        guard = self.guard = [t for t in tensors if t.requires_grad]
        self.before = _marks(guard)
        return True  # (some shared one does not require grad: it needs clones)

    def private(self, per_device: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """``per_device`` (each replica's parameter tensors, by slot) with copy-on-write clones
        of the shared tensors that do not require grad for the replicas after the first, and
        the shared ones that do guarded for this call; the tensors of its own each replica
        after the first has for a parameter that does not require grad marked (``land``)."""
        out = self._private(per_device)
        params = self.params
        if len(out) < 2 or all(map(_REQUIRES_GRAD, params)):
            if self.frozen[0]:
                self.frozen, self.frozen_marks = ([], []), (None, [])
            return out
        # The slots that do not require grad, and a getter of them, kept while the flags are
        # as they were (read in one pass: they change without any write we could see).
        key = (len(out), list(map(_REQUIRES_GRAD, params)))
        kept = self.slots
        if kept is None or kept[0] != key:
            frozen = [i for i, flag in enumerate(key[1]) if not flag]
            pairs = [(i, j) for j in range(1, len(out)) for i in frozen]
            # (a tuple even for one slot: the first slot again, sliced off)
            self.slots = kept = (key, operator.itemgetter(*frozen, frozen[0]), pairs)
        _, take, pairs = kept
        n = len(pairs) // (len(out) - 1)
        tensors = [*take(out[0])[:n]] * (len(out) - 1)  # replica 0's, once per other replica
        for j in range(1, len(out)):
            tensors += take(out[j])[:n]
        self.frozen = (pairs, tensors)
        cow = list(map(_IS_COW, tensors))
        # (every one copy-on-write, the clones on a shared device and their sources: a write
        # to one clears its flag, so no versions or addresses are needed)
        self.frozen_marks = (None if all(cow) else _marks(tensors), cow)
        return out

    def _private(self, per_device: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """:meth:`private`'s clones and guard."""
        if self.shared is None:
            self.shared = _shared_slots(per_device)
            self.tensors = [self.params[i] for i in self.shared]
        shared = self.shared
        if not shared:
            self.guard = []
            return per_device
        tensors = self.tensors
        if (
            len(tensors) == len(self.params)
            and all(map(operator.is_, per_device, repeat(self.params)))
            and all(map(_REQUIRES_GRAD, tensors))
        ):
            # Every replica uses the parameters themselves (a CPU list of a model with
            # buffers), all trainable: the guard is every parameter, read in a few passes in C
            # (as ``arm`` does), not one step per parameter and replica below.
            self.guard = tensors
            self.before = _marks(tensors)
            self.clones.clear()
            return per_device
        guard: dict[int, torch.Tensor] = {}
        frozen: list[int] = []
        for i in shared:
            if per_device[0][i].requires_grad:
                for tensors in per_device:
                    guard[id(tensors[i])] = tensors[i]
            else:
                frozen.append(i)
        self.guard = list(guard.values())
        self.before = _marks(self.guard)
        if not frozen:
            self.clones.clear()
            return per_device
        clones = self.clones
        kept: dict[tuple[int, int], Pair] = {}
        out = [per_device[0]]
        # Which kept clones are current, read for all before any clone is made: a clone makes
        # its source copy-on-write again, and with it every tensor on the same storage (views
        # of one flat buffer), whose own clone would then look current.
        current = {
            key for key, (source, clone, _) in clones.items() if _IS_COW(source) and _IS_COW(clone)
        }
        for j in range(1, len(per_device)):
            mine = list(per_device[j])
            for i in frozen:
                source = mine[i]
                entry = clones.get((j, i))
                if entry is None or entry[0] is not source:
                    entry = _pair(source, _clone(source))
                elif (j, i) not in current:
                    # The same clone object, its data rebound to the module's value: a graph
                    # an earlier call saved it in then reads what this call's forward writes,
                    # as on one device (a spectral norm's ``u``, two calls, one backward).
                    entry = _pair(source, resync(entry[1], _clone(source)))
                kept[j, i] = entry
                mine[i] = entry[1]
            out.append(mine)
        self.clones = kept
        return out

    def land(self, replica: Any, dropped: bool = False) -> None:
        """After the replicas ran (``dropped``: without replica 0 of the set, as a later wave
        under ``max_size`` runs, whose writes are all dropped, so nothing lands and nothing is
        said): a frozen parameter that a replica after the first wrote and
        replica 0 did not (a write made only for a chunk that holds some sample: a counter of
        flagged samples) gets that replica's write, the first such replica's, as one device
        writes it once per call; said once per parameter, since every other replica computed
        its chunk with the value from before it. One that replica 0 wrote and no other replica
        did is on the module already, and said the same way. Each replica's own tensor (a clone
        on a shared device, a copy on another) and replica 0's are read by their versions and data
        addresses, marked at the sync, and a copy-on-write one by whether it still is (a write
        through ``.data`` moves no version: that flag does move); in three passes while none
        was written (a frozen backbone).

        An in-place write through ``.data`` moves no version or address of a tensor that is not
        copy-on-write (a copy on another device, the module's parameter where the others hold
        copies), so a later replica's such write is not seen. Where replica 0's tensor is of
        that kind, a write through ``.data`` (no version moved) by a replica whose tensor was a
        clone does not land either: replica 0's own such write could not have shown, and a
        running statistic every replica writes keeps replica 0's, as BatchNorm's does.

        The copy keeps the parameter's version: a graph replica 0 saved it in (a frozen factor)
        then reads the written value in backward, as one device's graph, whose forward read it
        after the write, does; an in-place write of ours would make that backward raise."""
        pairs, tensors = self.frozen
        before, cow = self.frozen_marks
        n, m = len(pairs), len(tensors)
        if before is None:  # (all copy-on-write at the sync)
            if all(map(_IS_COW, tensors)):  # no replica wrote
                return
            written = [not flag for flag in map(_IS_COW, tensors)]
        else:
            now, cow_now = _marks(tensors), list(map(_IS_COW, tensors))
            if now == before and cow_now == cow:
                return
            written = [
                now[k] != before[k] or now[m + k] != before[m + k] or cow[k] > cow_now[k]
                for k in range(m)
            ]
        clones = self.clones
        for k, (i, j) in enumerate(pairs):
            # (a pair either side of which was written is made again at the next call: its
            # anchor, now perhaps the only holder of the memory from before, goes now)
            if written[k] or written[n + k]:
                entry = clones.get((j, i))
                if entry is not None and entry[2] is not None:
                    clones[j, i] = (entry[0], entry[1], None)
        if dropped:
            return
        done: set[int] = set()
        # (the slots some replica after the first wrote: one pass, not one per pair)
        others = {i for k, (i, _) in enumerate(pairs) if written[n + k]}
        # Replica 0's writes by memory: copy-on-write tells a write to the memory, so views of
        # one buffer are written together, and said together; a view some later replica wrote
        # explains the others' flag.
        mine: dict[int, dict[int, torch.Tensor]] = {}
        for k, (i, _) in enumerate(pairs):
            if written[k] and i not in self.landed:
                mine.setdefault(memory_of(tensors[k]), {})[i] = tensors[k]
        for views in mine.values():
            if others.isdisjoint(views):  # (replica 0's own write, in no other replica)
                self.landed.update(views)
                warn_user(chunk_write(tensor_names(replica, [*views.values()]), 0))
        for k, (i, j) in enumerate(pairs):
            # (replica j's own tensor written; replica 0's not, by it or an earlier replica)
            if i in done or not written[n + k] or written[k]:
                continue
            if before is not None and not cow[k] and cow[n + k] and now[n + k] == before[n + k]:
                continue  # (through ``.data``: replica 0's own such write would not show)
            source, theirs = tensors[k], tensors[n + k]
            done.add(i)
            version = source._version
            with torch.no_grad():
                source.copy_(theirs)
            _SET_VERSION((source,), (version,))
            if i not in self.landed:
                self.landed.add(i)
                warn_user(chunk_write(tensor_names(replica, [source]), j))

    def refuse(self, replica: Any, now: list[int | None]) -> None:
        """Refuse the call if forward wrote a trainable parameter its replicas share: ``now``,
        the guard's marks after the replicas ran, differ from those taken before."""
        guard, before = self.guard, self.before
        n = len(guard)
        written = [
            t for i, t in enumerate(guard) if now[i] != before[i] or now[n + i] != before[n + i]
        ]
        self.before = now
        names = tensor_names(replica, written)
        raise RuntimeError(
            f"module: forward wrote the trainable parameter{'s' if len(names) > 1 else ''} "
            f"{', '.join(names)} (in place under torch.no_grad(), or by a .data assignment), "
            f"which the replicas share on this device list: each replica wrote it, in a race, "
            f"where one device writes it once per call. Write it outside the wrapped call "
            f"(before model(x), as an optimizer step does; for nn.Embedding(max_norm=...), "
            f"renormalise the rows with torch.embedding_renorm_ before the call and drop "
            f"max_norm), or, if forward must write it, set requires_grad=False on it (each "
            f"replica then writes its own copy) or give each replica a device of its own"
        )


_NO_MARKS: dict[str, Any] = {}  # (read only: an object without a ``__dict__``)


def check_writes(replicas: Sequence[Any]) -> None:
    """After the replicas of one call ran: refuse the call if forward wrote a trainable
    parameter the replicas share (their versions or data addresses moved since ``arm`` or
    ``private`` took them; ``ForwardWrites.refuse``)."""
    if len(replicas) > 1:
        writes = getattr(replicas[1], "__dict__", _NO_MARKS).get(WRITES)
        if writes is not None:
            guard = writes.guard
            if guard:
                try:
                    now = [*map(_VERSION_OF, guard), *map(_PTR, guard)]
                except RuntimeError:
                    now = _marks(guard)
                if now != writes.before:
                    writes.refuse(replicas[0], now)
            first = replicas[0]
            if writes.head is None:
                ran = getattr(first, "__dict__", _NO_MARKS).get(WRITES) is not writes
            else:
                ran = id(first) == writes.head
            if writes.frozen[0]:
                writes.land(first, dropped=not ran)
            if writes.buffers.before is not None:  # (after ``land``: a buffer's views)
                writes.buffers.land(first, dropped=not ran)
            owner = None if writes.own is None else writes.own()
            if owner is not None:
                owner.after_call(ran)
            holders = writes.holders
            if holders is not None and holders.watched:
                holders.said_written(replicas[0], len(replicas))


def _marks(tensors: list[torch.Tensor]) -> list[int | None]:
    """Each tensor's version (an in-place write), then each one's data address (a ``.data =``
    assignment), in one flat list read by two C-level passes; the address read without making
    a copy-on-write tensor copy."""
    try:
        return [*map(_VERSION_OF, tensors), *map(_PTR, tensors)]
    except RuntimeError:  # one without: an inference tensor, a functorch wrapper
        marks = list(map(_mark, tensors))
        return [*(m[0] for m in marks), *(m[1] for m in marks)]


def _mark(tensor: torch.Tensor) -> tuple[int, int | None]:
    """``_marks`` for one tensor: ``-1`` for no version (an inference tensor), ``None`` for
    no storage (a functorch wrapper)."""
    version = -1 if tensor.is_inference() else tensor._version
    try:
        return version, _PTR(tensor)
    except RuntimeError:
        return version, None


def _shared_slots(per_device: list[list[torch.Tensor]]) -> list[int]:
    """The slots whose tensor a replica after the first shares with another replica."""
    if len(per_device) < 2:
        return []
    shared = []
    for i in range(len(per_device[0])):
        seen: set[int] = set()
        for tensors in per_device:
            key = id(tensors[i])
            if key in seen:
                shared.append(i)
                break
            seen.add(key)
    return shared


def resync(kept: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``kept`` with its data rebound to ``fresh`` (a copy of the module's value): the same
    tensor object, so a graph an earlier call saved it in reads what later calls write, as it
    reads the module's own tensor on one device. ``.data =`` bumps no version, as the user's
    own ``u.data = ...`` does not. ``fresh`` itself where ``kept`` cannot take it (another
    kind of tensor, or the module's tensor now has another device or layout)."""
    if kept.device != fresh.device or kept.layout != fresh.layout or kept.is_inference():
        return fresh
    try:
        kept.data = fresh
    except RuntimeError:  # incompatible tensor types
        return fresh
    return kept


def _pair(source: torch.Tensor, clone: torch.Tensor) -> Pair:
    """A clones entry: ``source``, its ``clone``, and a third copy-on-write holder of their
    memory (``None`` where ``clone`` is a plain copy), which no replica is given. While it
    lives no replica's write is the last one to the memory, so each writer copies it: torch
    hands the last writer the memory itself, unguarded against a writer of the other side
    that is still copying it in another thread, and the heap is corrupted (torch 2.13)."""
    return source, clone, _LAZY_CLONE(clone) if _IS_COW(clone) else None


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    """A replica's own copy of ``tensor`` (which does not require grad), sharing its memory
    until either is written. Made outside inference mode, so a later call may write it or
    save it for backward; a tensor that cannot be cloned lazily is copied."""
    with torch.inference_mode(False), torch.no_grad():
        try:
            return _LAZY_CLONE(tensor.detach())
        except (RuntimeError, NotImplementedError):  # (a tensor with no plain storage)
            return tensor.detach().clone()
