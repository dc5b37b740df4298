"""Buffers written in place inside forward by one replica alone: landed on the module, said.

Replica 0 uses the module's own buffers (or, where it is a copy, its writes are copied back
after the call), so what its forward writes into a buffer lands once per call, as on one
device. Every replica after the first computes with a private copy, brought in line with
the module's buffer at each sync. A write that only a later replica makes (a counter of
flagged samples, ``self.seen += x[flagged].sum(0)``, whose flagged sample sits in replica 1's
chunk) went to that copy and was lost at the next sync, where one device would have made it.

A write is read by mechanism: each copy's version counter, and replica 0's, marked at the sync
and read after the call (one pass in C each while nothing was written). Where a later replica
wrote a buffer and replica 0 did not, its value is copied onto replica 0's (the first such
replica's, keeping replica 0's version, so a graph replica 0 saved it in reads the written
value in backward, as one device's graph, which read it after the write, does), and that is
said once per buffer: every other replica computed its chunk with the value from before the
write. Where replica 0 alone wrote it, the module has the write, and that is said the same
way. Where several replicas wrote it (BatchNorm's ``num_batches_tracked``), replica 0's write
stands, from its chunk, as torch's own replicas give. BatchNorm's running statistics are
written by its kernel without a version bump: not read here, as they are every replica's.

The copies are made outside inference mode in every mode (``_sync``), so their versions are
read under ``torch.inference_mode()`` too. Not read: writes through ``.data`` (a tensor of
its own, with a version of its own), and a module's buffer that is itself an inference tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import compress
from typing import Any

import torch
from torch import nn

from dataparallel._common.warn import warn_user

__all__ = ["BufferWrites", "chunk_write", "memory_of", "tensor_names"]

_VERSION_OF = operator.attrgetter("_version")
_SET_VERSION = torch._C._autograd._unsafe_set_version_counter


class BufferWrites:
    """The private buffer copies of the replicas after the first, replica 0's tensor for each
    such buffer, and their versions at the last sync."""

    __slots__ = ("before", "key", "pairs", "said", "slots", "tensors")

    def __init__(self) -> None:
        self.slots: list[int] = []  # the buffer slots a later replica has a copy of
        self.pairs: list[tuple[int, int]] = []  # each copy's (buffer slot, replica >= 1)
        # Replica 0's tensor for each of ``slots`` (read once however many replicas), then
        # each copy of ``pairs``.
        self.tensors: list[torch.Tensor] = []
        self.before: list[int] | None = None  # their versions at the sync; None: not read
        self.key: Any = None  # the sync's reusable copy (``Ready``) the pairs were read from
        self.said: set[int] = set()  # the slots whose write was said

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        """Pickled or copied with a replica (``torch.save(replica)``) without this call's
        tensors: the copy marks its own at its next sync."""
        state: dict[str, Any] = {"slots": [], "pairs": [], "tensors": [], "before": None}
        return None, {**state, "key": None, "said": self.said}

    def mark(self, replicas: Sequence[Any], buffers: list[torch.Tensor], ready: Any) -> None:
        """At the sync, after the copies are in line: pair each later replica's private copy
        with replica 0's tensor for that buffer and read their versions (about 0.07 µs a
        tensor). The pairs are kept while the sync reuses its fused copy (``ready``: the same
        copy objects)."""
        if ready is None or ready is not self.key:
            first = replicas[0].buffers(buffers)
            pairs: list[tuple[int, int]] = []
            theirs: list[torch.Tensor] = []
            for j in range(1, len(replicas)):
                row = replicas[j].private
                for i in replicas[j].private_slots:
                    pairs.append((i, j))
                    theirs.append(row[i])
            self.slots = sorted({i for i, _ in pairs})
            self.pairs, self.key = pairs, ready
            self.tensors = [*(first[i] for i in self.slots), *theirs]
        try:
            self.before = list(map(_VERSION_OF, self.tensors))
        except RuntimeError:  # an inference tensor: no version to read
            self.before = None

    def land(self, replica: nn.Module, dropped: bool) -> None:
        """After the replicas ran (``dropped``: without replica 0, a later wave under
        ``max_size``, whose writes are dropped): land and say a later replica's lone write,
        say replica 0's lone write."""
        before, tensors = self.before, self.tensors
        if before is None:
            return
        now = list(map(_VERSION_OF, tensors))
        self.before = None  # (read once per sync)
        if now == before or dropped:
            return
        slots, pairs, m = self.slots, self.pairs, len(self.slots)
        # (the tensors written, found in C: a step counter every replica moves is the usual)
        changed = list(compress(range(len(now)), map(operator.ne, now, before)))
        mine = {slots[k] for k in changed if k < m}
        theirs: dict[int, int] = {}  # slot -> the first later replica's copy that was written
        for k in changed:
            if k >= m:
                theirs.setdefault(pairs[k - m][0], k)
        for i in mine - theirs.keys() - self.said:
            source = tensors[slots.index(i)]
            self.said.add(i)
            # (a buffer whose memory parameters view is said by their memory, ``_written``:
            # a write to a view moves the buffer's version, not a later replica's copy's)
            if memory_of(source) not in {memory_of(p) for p in replica.parameters()}:
                warn_user(chunk_write(tensor_names(replica, [source], "buffer"), 0, "buffer"))
        for i, k in theirs.items():
            if i in mine:
                continue  # replica 0 wrote it too: its write stands
            source, written = tensors[slots.index(i)], tensors[k]
            version = source._version
            with torch.no_grad():
                if source.shape != written.shape:  # (resized in place, as one device would)
                    source.resize_(written.shape)
                source.copy_(written)
            _SET_VERSION((source,), (version,))
            if i not in self.said:
                self.said.add(i)
                names = tensor_names(replica, [source], "buffer")
                warn_user(chunk_write(names, pairs[k - m][1], "buffer"))


def memory_of(tensor: torch.Tensor) -> int:
    """The identity of the memory ``tensor`` is a view of (no copy-on-write copy made)."""
    return int(tensor.untyped_storage()._cdata)


def tensor_names(replica: Any, tensors: list[torch.Tensor], kind: str = "parameter") -> list[str]:
    """The names of ``tensors``, parameters (or buffers: ``kind``), in replica 0 (the module
    itself, or a replica with the same names), quoted."""
    ids = {id(t) for t in tensors}
    names: list[str] = []
    if isinstance(replica, nn.Module):
        named = replica.named_buffers if kind == "buffer" else replica.named_parameters
        names = [repr(n) for n, t in named(remove_duplicate=False) if id(t) in ids]
    return names or [f"(a {kind} copy of this device list)"]


def chunk_write(names: list[str], j: int, kind: str = "parameter") -> str:
    """The warning for a frozen parameter or a buffer (``kind``; ``names``) that replica ``j``
    alone wrote, or for several parameters that are views of one memory, written together."""
    if kind == "buffer":
        what = f"the buffer {names[0]}"
    elif len(names) == 1:
        what = f"the parameter {names[0]} (it does not require grad)"
    else:
        what = (
            f"the memory of the parameters {', '.join(names)} (they do not require grad, "
            f"and are views of one tensor: a write to one is a write to all)"
        )
    where = (
        "in replica 0 (its chunk) and in no other replica: the module has its write"
        if j == 0
        else f"in replica {j} (its chunk), and not in replica 0: its write was copied onto the "
        f"module after the call"
    )
    return (
        f"module: forward wrote {what} {where}, as one "
        f"device makes it once per call, but every other replica computed its chunk with the "
        f"value from before it, where one device computes every sample after a write made "
        f"before the read. To have every sample see it, make the write outside the wrapped "
        f"call (from the batch, before model(x)); said once"
    )
