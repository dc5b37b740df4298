"""Parameters written inside forward: one write per call, as on one device.

A momentum encoder updates its key encoder inside forward (MoCo: ``param_k.data =
param_k.data * m + param_q.data * (1 - m)``; BYOL: ``param_k.data.mul_(m).add_(...)``). Where
the replicas share the module's parameters (a list that repeats a device: ``["cpu", "cpu"]``,
``[0, 0]``, the copies of ``"cpu:1"`` shared by two replicas there), every replica would write
the same tensor: the number of updates per call would be a race, and each replica would
compute with whatever the others had written so far. On one device, and with torch on
separate GPUs, the update happens once, and every chunk is computed with it.

So a set whose replicas share parameter tensors learns which of them forward writes. The first
call in each training mode (``module.training``) gives every replica after the first its own
copy of every shared parameter that does not require grad (a key encoder, an EMA teacher: a
parameter trained by backprop and also written in forward would need autograd's leave), and
the next sync reads which copies the call changed: in place, through ``.data``, or by a
``.data =`` assignment. Since a write through ``.data`` bumps no version counter, each copy's
float64 sum and norm are taken when it is made and compared then (no second copy is kept).
From then on the replicas after the first get a fresh copy of each written parameter on every
call; replica 0 (the module itself) writes the module's own, once. Parameters not written stay
shared, at no cost; what a set learned passes to the set that replaces it (a ``.data =``
assignment moves the parameter's data, which rebuilds the set). A forward that writes a
parameter only on later calls, never on the first call in its mode, is not seen (the guide
says so).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ForwardWrites"]

# (parameter slot, the replica's copy, what it was when made: data pointer, version, sums)
_Watched = list[tuple[int, torch.Tensor, tuple[int, int, torch.Tensor]]]


class ForwardWrites:
    """Which shared parameters a replica set's forward writes, and the private copies that
    keep each replica's write its own."""

    __slots__ = ("learned", "shared", "watch", "written")

    def __init__(self) -> None:
        self.shared: list[int] | None = None  # slots shared by two replicas (read at 1st sync)
        self.learned: set[bool] = set()  # training modes whose first call was watched
        self.written: list[int] = []  # slots a forward wrote
        self.watch: _Watched | None = None  # the copies of the last watched call

    def pending(self, training: bool) -> bool:
        """Whether this call needs private copies (or a watched call to read): a sync that
        would otherwise have nothing to do must not skip them."""
        if not self.shared:
            return False
        return training not in self.learned or bool(self.written) or self.watch is not None

    def private(
        self, training: bool, per_device: list[list[torch.Tensor]]
    ) -> list[list[torch.Tensor]]:
        """``per_device`` (each replica's parameter tensors, by slot) with private copies for
        the replicas after the first: of every shared parameter on a watched call, of the
        written ones after."""
        if self.shared is None:
            self.shared = _shared_slots(per_device)
        if not self.shared:
            return per_device
        self._read_watch()
        watching = training not in self.learned
        if watching:  # parameters trained by backprop are left shared
            slots = [i for i in self.shared if not per_device[0][i].requires_grad]
        else:
            slots = self.written
        if not slots:
            if watching:
                self.learned.add(training)
            return per_device
        watched: _Watched = []
        out = [per_device[0]]
        for tensors in per_device[1:]:
            mine = list(tensors)
            for i in slots:
                copy = _private(mine[i])
                mine[i] = copy
                if watching:
                    watched.append((i, copy, _state(copy)))
            out.append(mine)
        if watching:
            self.learned.add(training)
            self.watch = watched
        return out

    def inherit(
        self,
        old: ForwardWrites,
        old_params: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
    ) -> None:
        """What the set this one replaces learned, by parameter: a ``.data =`` assignment in
        forward moves a parameter's data, which rebuilds the set on the next call."""
        old._read_watch()
        ids = {id(old_params[i]) for i in old.written}
        self.written = [i for i, p in enumerate(params) if id(p) in ids]
        self.learned = set(old.learned)

    def _read_watch(self) -> None:
        """Mark written every parameter whose copy the watched call changed."""
        watched, self.watch = self.watch, None
        if not watched:
            return
        written = set(self.written)
        for i, copy, before in watched:
            if i not in written and not _same_state(_state(copy), before):
                written.add(i)
        self.written = sorted(written)


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


def _state(tensor: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """What tells a copy was written: its data pointer (a ``.data =`` assignment), version (an
    in-place write) and float64 sum and norm (a write through ``.data``, which bumps no
    version)."""
    data = tensor.detach()
    if not (data.is_floating_point() or data.is_complex()):
        data = data.to(torch.float64)  # (an integer parameter: a counter, with no grad)
    sums = torch.stack(
        [data.sum(dtype=torch.float64), torch.linalg.vector_norm(data, dtype=torch.float64)]
    )
    return tensor.detach().data_ptr(), tensor._version, sums


def _same_state(now: tuple[int, int, torch.Tensor], before: tuple[int, int, torch.Tensor]) -> bool:
    return now[:2] == before[:2] and bool(now[2].equal(before[2]))


def _private(tensor: torch.Tensor) -> torch.Tensor:
    """A replica's own copy of ``tensor``, on its device: differentiable where grad is enabled
    and the tensor requires it (the gradient flows back to the module's own parameter)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return tensor.clone()
    with torch.no_grad():
        return tensor.detach().clone()
