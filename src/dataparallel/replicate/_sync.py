"""What each call copies so the replicas compute with the module's current tensors.

``TensorSync`` is the tensor half of ``_replicas.Replicas`` (its base class): the replica
objects are built and refilled there, their parameters and buffers brought in line here.

- parameters: both attributes and ``_parameters`` entries of the replica, so
  ``self.parameters()`` inside forward lists what the replica computes with. A replica on a
  parameter's own device uses the parameter itself (no copy, the gradient lands on it
  directly). On another device, with grad enabled, every call makes fresh
  copies (differentiable ones, torch's ``Broadcast`` between CUDA devices and
  ``param.to(device)`` otherwise, so gradients flow back to the module's own parameters). With
  grad disabled the copies made by an earlier call without grad are refreshed in place, in one
  fused copy (no cheap test can tell a parameter changed: fused optimizers and ``p.data``
  updates do not bump ``_version``);
- buffers: replica 0 uses the module's own buffers when it sits on their device, so BatchNorm
  running statistics update exactly as in torch, from replica 0's chunk; every other replica
  has private copies, written in place while nothing else holds them, else made anew, outside
  inference mode in every mode (a version counter: ``_buffer_writes`` reads it).

Copy on write: a tensor that an autograd graph may have saved is never overwritten. Parameter
copies: only calls with grad enabled build graphs, and they always get new copies; the copies
refreshed in place were made, and have only been used, by calls without grad (in the same
mode: inference tensors stay inference tensors). Buffer copies: a graph that saved one holds
a reference to it (``Tensor._use_count`` above 1), and a graph that saved an alias of it
(``buf.detach()``, ``buf.data``, a view), which shares its version counter, holds its storage
(the storage's use count above one per tensor), until backward frees the graph. So two calls
then one backward, ``max_size`` waves, BatchNorm in ``eval()`` and buffers used as factors,
directly or through an alias, all differentiate what their own call saw.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable

import torch
from torch import nn

from dataparallel.replicate._records import NOT_YET, Key, Ready, Replica, Source, Target
from dataparallel.replicate._written import ForwardWrites, resync

__all__ = ["TensorSync"]

# One fused call for many buffer copies (private in torch, present since 2.1).
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


class TensorSync:
    """Syncs the parameter copies and private buffer copies of a replica set; the set
    (``Replicas``) builds the tables below once per structure."""

    params: list[nn.Parameter]
    buffers: list[torch.Tensor]
    replicas: list[Replica]
    views: dict[Key, Target]
    targets: list[Target]
    by_source: dict[Key, list[int]]
    with_buffers: list[Source]
    ready: Ready | None
    writes: ForwardWrites

    def adopt(self, old: TensorSync) -> None:
        """Take over the copies of frozen parameters that ``old``, the set this one replaces
        (same module, same devices), gave its replicas: the same tensor objects, re-synced at
        the next call, so a graph an earlier call saved one in reads what later calls write
        into it, as on one device (``_written.resync``). A spectral norm whose forward
        assigns ``u.data`` gives its parameter a new address on every call, which rebuilds
        the set (``structure_key``) each time."""
        if len(old.replicas) != len(self.replicas):
            return
        slot = {id(p): i for i, p in enumerate(self.params)}
        params = old.params  # (a clone's source is the parameter, or its copy on a device)
        self.writes.clones = {
            (j, slot[id(params[i])]): entry
            for (j, i), entry in old.writes.clones.items()
            if id(params[i]) in slot
        }
        for key, target in self.views.items():
            before = old.views.get(key)
            if before is not None:
                target.frozen = {
                    slot[id(source)]: (source, kept)
                    for source, kept in before.frozen.values()
                    if id(source) in slot
                }

    # -- parameters -------------------------------------------------------------------------

    def _sync_params(self) -> list[list[torch.Tensor]]:
        """Per replica, per parameter slot: the tensor it uses."""
        targets = self.targets
        if not targets:  # every replica sits on its parameters' devices: share them all
            return [self.params] * len(self.replicas)  # type: ignore[list-item]
        mode = _mode()
        if mode is None:
            self._copy_fresh()
        else:
            for target in targets:
                self._copy_in_place(target, mode)
        # New lists: a replica's install compares them with the last ones it got.
        views = {k: list(t.tensors) if t.remote else t.tensors for k, t in self.views.items()}
        return [views[r.key] for r in self.replicas]

    def _copy_fresh(self) -> None:
        """Grad enabled: new copies, differentiable, that no later call ever writes."""
        params = self.params
        for source, slots in self.by_source.items():
            dests = [t for t in self.targets if t.key != source]
            if not dests:
                continue
            for t in dests:
                t.mode = None  # graph-bound: never refreshed in place
            if source[0] == "cuda" and all(t.key[0] == "cuda" for t in dests):
                from torch.nn.parallel._functions import Broadcast

                # One coalesced, differentiable broadcast; its backward is a reduce-add onto
                # the source device, as in torch.nn.parallel.replicate.
                indices = [source[1], *(t.key[1] for t in dests)]
                out = Broadcast.apply(indices, *(params[i] for i in slots))
                n = len(slots)
                for d, t in enumerate(dests, start=1):
                    for s, i in enumerate(slots):
                        t.tensors[i] = out[d * n + s]
            else:
                for t in dests:
                    for i in slots:
                        t.tensors[i] = _copy_to(params[i], t.device)
            frozen = [i for i in slots if not params[i].requires_grad]
            for t in dests if frozen else ():
                _keep_frozen(t, params, frozen)

    def _copy_in_place(self, target: Target, mode: str) -> None:
        """Grad disabled: refresh ``target``'s copies from the module's parameters.

        Every call copies (one fused copy into the existing tensors): no cheap test tells that a
        parameter changed, since fused optimizers and ``p.data`` updates do not bump
        ``_version``. The copies are written in place only when a call in this same mode made
        them (no graph can hold them); otherwise new ones are made.
        """
        params, tensors = self.params, target.tensors
        fresh = target.mode != mode
        target.mode = None  # until every copy is in ``mode``
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        with torch.no_grad():
            for i in target.remote:
                p, c = params[i], tensors[i]
                if fresh or c.shape != p.shape or c.dtype != p.dtype:
                    tensors[i] = _copy_to(p.detach(), target.device)
                else:
                    dests.append(c)
                    sources.append(p.detach())
            _copy_all(dests, sources)
        target.mode = mode

    # -- buffers ----------------------------------------------------------------------------

    def _current_buffers(self, root: nn.Module) -> list[torch.Tensor]:
        """The module's buffers now: one may have been reassigned (same shape) since the build."""
        current = list(self.buffers)
        for s in self.with_buffers:
            bufs = (root if s.module is None else s.module)._buffers
            for name, slot in zip(s.buffer_names, s.buffer_slots, strict=True):
                current[slot] = bufs[name]  # type: ignore[assignment]
        return current

    def _sync_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Bring every private buffer copy in line with the module's buffers.

        A copy is written in place only when nothing but this set holds it: its tensor's use
        count is 1 and no other tensor shares its storage, so no autograd graph saved it or an
        alias of it (BatchNorm in ``eval()`` and a buffer used as a factor are saved,
        ``buf.detach()`` and views share its version counter; both counts drop back once the
        graph is freed). Else a new copy is made. A buffer that requires grad is copied
        differentiably on every call with grad enabled, as torch broadcasts it. The writes are
        one fused copy: BatchNorm updates running statistics without bumping ``_version``, so
        no cheap test can tell that either side changed.
        """
        if not self.buffers:  # no buffer, no copy (a buffer added later is a new structure)
            return
        mode = _mode()
        inference = mode == "inference"
        ready = self.ready
        if (
            ready is not None
            and ready.inference == inference
            and ready.buffers is buffers
            and max(map(_USE_COUNT, ready.dests), default=1) == 1
            and max(map(_STORAGE_USE_COUNT, ready.storages), default=_ALONE) == _ALONE
            and list(map(_SHAPE, ready.watched)) == ready.shapes
        ):
            try:  # every copy free to write, as the last call left them
                _copy_all(ready.dests, ready.sources)
                self.writes.buffers.mark(self.replicas, buffers, ready)
                return
            except RuntimeError:  # pragma: no cover - the careful path says why
                pass
        self.ready = None
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        reusable = True
        with torch.no_grad():
            for replica in self.replicas:
                row, device = replica.private, replica.device
                for i in replica.private_slots:
                    b = buffers[i]
                    mine = row[i]
                    if mode is None and b.requires_grad:
                        with torch.enable_grad():
                            row[i] = _copy_to(b, device)
                        reusable = False
                    elif (
                        mine is NOT_YET
                        or mine is None
                        or mine.is_inference()
                        or mine.shape != b.shape
                        or mine.dtype != b.dtype
                        or _USE_COUNT(mine) != 1
                        or _aliased(mine)
                    ):
                        # (made outside inference mode in every mode: a version counter,
                        # which ``BufferWrites`` reads for a write only this replica made)
                        with torch.inference_mode(False):
                            row[i] = _copy_to(b.detach(), device)
                    else:
                        dests.append(mine)
                        # The buffer itself, not an alias: an alias would keep reading the old
                        # data after ``b.set_(t)`` or ``swap_tensors`` (the copy runs without grad).
                        sources.append(b)
            _copy_all(dests, sources)
        if reusable:
            # Next time, in this mode, on these buffers: one fused copy and nothing else.
            mine_all: list[torch.Tensor] = []
            theirs: list[torch.Tensor] = []
            for replica in self.replicas:
                for i in replica.private_slots:
                    mine_all.append(replica.private[i])  # type: ignore[arg-type]
                    theirs.append(buffers[i])
            # A copy with no storage to count (sparse): the careful path on every call.
            with contextlib.suppress(RuntimeError, TypeError, NotImplementedError):
                self.ready = Ready(inference, buffers, mine_all, theirs)
        self.writes.buffers.mark(self.replicas, buffers, self.ready)


def _mode() -> str | None:
    """The grad mode of this call: ``None`` when grad is enabled (a graph may save what the
    call uses), else ``"inference"`` or ``"no_grad"`` (tensors made in one cannot be written
    in the other)."""
    if torch.is_grad_enabled():
        return None
    return "inference" if torch.is_inference_mode_enabled() else "no_grad"


def _held_elsewhere(tensor: torch.Tensor) -> int:
    return 2  # no use count to read (a torch without it): never write a copy in place


# How many owners a tensor has (1: only its Python object; a graph that saved it is another).
_USE_COUNT: Callable[[torch.Tensor], int] = getattr(torch.Tensor, "_use_count", _held_elsewhere)

# How many owners a storage has, from its address (``UntypedStorage._cdata``): one per tensor
# on it, and one for its Python object (kept alive by whoever holds it, and only ever one).
# So a private copy alone on its storage reads ``_ALONE`` while we hold its Python object;
# an alias (``.detach()``, ``.data``, a view) a graph saved adds one.
_ALONE = 2
_SHAPE = operator.attrgetter("shape")
_STORAGE_USE_COUNT: Callable[[int], int] = getattr(
    torch._C, "_storage_Use_Count", lambda cdata: _ALONE + 1
)


def _aliased(tensor: torch.Tensor) -> bool:
    """Whether another tensor may share ``tensor``'s storage (an alias a graph may have
    saved): always, for a tensor with no storage to count (sparse, a wrapper subclass)."""
    try:
        return _STORAGE_USE_COUNT(tensor.untyped_storage()._cdata) > _ALONE
    except (RuntimeError, TypeError, NotImplementedError):
        return True


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor with ``tensor``'s value on ``device`` (differentiable where it requires
    grad). On the tensor's own device (``"cpu:1"`` is the CPU) a clone, which costs half of
    ``.to(device, copy=True)``'s dispatch."""
    here = tensor.device
    if here.type == device.type and (here.type == "cpu" or here.index == device.index):
        return tensor.clone()
    return tensor.to(device, copy=True)


def _keep_frozen(target: Target, params: list[nn.Parameter], slots: list[int]) -> None:
    """Give ``target`` its kept copy object of each parameter in ``slots`` (none requires
    grad), its data rebound to this call's new copy.

    On one device a graph saves the module's own tensor: a later call's ``u.data = ...`` in
    forward (a spectral norm's power iteration) is what an earlier call's pending backward
    reads. A copy kept as the same object across calls gives each replica that reading too;
    a new object per call would keep each call's own value."""
    kept = target.frozen
    tensors = target.tensors
    for i in slots:
        entry = kept.get(i)
        if entry is None or entry[0] is not params[i]:
            kept[i] = (params[i], tensors[i])
        else:
            tensors[i] = resync(entry[1], tensors[i])
            kept[i] = (params[i], tensors[i])


def _copy_all(dests: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if not dests:
        return
    with torch.no_grad():
        if _FOREACH_COPY is not None:
            _FOREACH_COPY(dests, sources)
        else:  # pragma: no cover - torch without the fused copy
            for dest, source in zip(dests, sources, strict=True):
                dest.copy_(source)
