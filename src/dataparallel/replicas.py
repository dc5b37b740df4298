"""The replicas of one module on one device tuple: built once, then kept in step with it.

:class:`Replicas` has three jobs, each in its own part below: build the replica objects for a
structure (one per submodule per device, tied parameters once); sync the tensors each call
(parameters shared or copied, private buffer copies re-copied); and refill the replicas'
dictionaries from their sources' (attributes, training flags, hooks), which the cache asks for
only after :mod:`dataparallel.mutations` has counted a change since the last sync.

What is synced, and why:

- plain attributes and training flags: each replica's ``__dict__`` is refilled from its source
  module's (so ``model.scale = 3.0`` or ``model.eval()`` is seen at the next call);
- parameters: a replica on a parameter's own device uses the parameter itself (no copy, the
  gradient lands on it directly). On another device, under autograd (grad enabled and some
  parameter requires grad), every call makes fresh differentiable copies (torch's
  ``Broadcast`` between CUDA devices, ``param.to(device)`` otherwise), so gradients flow back
  to the module's own parameters. In inference the copies are refreshed in place, in one fused
  copy per call (no cheap test can tell a parameter changed: fused optimizers and ``p.data``
  updates do not bump ``_version``);
- buffers: replica 0 uses the module's own buffers when it sits on their device, so BatchNorm
  running statistics update exactly as in torch, from replica 0's chunk; every other replica
  has private copies, re-synced with ``copy_`` each call, so no two threads write one tensor.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from dataparallel.fingerprint import fingerprint, signature

__all__ = ["Replicas"]

_BASE_REPLICATE = nn.Module._replicate_for_data_parallel
# One fused call for many buffer copies (private in torch, present since 2.1).
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)

_Key = tuple[str, int]


def _key(device: torch.device) -> _Key:
    # "mps" and "mps:0" are one device; resolved CUDA devices always carry an index.
    return (device.type, device.index or 0)


class Replicas:
    """The replica objects of one module on one device tuple, and what re-syncs them.

    Holds the root module only weakly (it is the side table's key); every other source module,
    parameter and buffer strongly, which keeps the fingerprint's ids valid.
    """

    def __init__(self, root: nn.Module, devices: tuple[torch.device, ...]) -> None:
        modules, sig = fingerprint(root)
        self.sig = sig
        self.sources: list[nn.Module | None] = [None, *modules[1:]]
        self.devices = devices
        self.keys = [_key(d) for d in devices]
        index = {id(m): i for i, m in enumerate(modules)}
        n = len(devices)

        # Parameters and buffers, deduplicated (tied weights get one copy per device).
        self.params: list[nn.Parameter] = []
        param_index: dict[int, int] = {}
        self.buffers: list[torch.Tensor] = []
        buffer_index: dict[int, int] = {}
        # Per module: (name, slot) pairs, and names that hold None.
        self.param_slots: list[list[tuple[str, int]]] = []
        self.buffer_slots: list[list[tuple[str, int]]] = []
        self.none_params: list[tuple[str, ...]] = []
        self.none_buffers: list[tuple[str, ...]] = []
        for module in modules:
            slots = []
            for name, p in module._parameters.items():
                if p is not None:
                    slots.append((name, param_index.setdefault(id(p), len(self.params))))
                    if slots[-1][1] == len(self.params):
                        self.params.append(p)
            self.param_slots.append(slots)
            self.none_params.append(tuple(k for k, v in module._parameters.items() if v is None))
            bslots = []
            for name, b in module._buffers.items():
                if b is not None:
                    bslots.append((name, buffer_index.setdefault(id(b), len(self.buffers))))
                    if bslots[-1][1] == len(self.buffers):
                        self.buffers.append(b)
            self.buffer_slots.append(bslots)
            self.none_buffers.append(tuple(k for k, v in module._buffers.items() if v is None))

        # Custom replication hooks (RNN's flat weights, fx.GraphModule) or a custom __setattr__
        # are honoured on every sync; plain modules take the fast dictionary path.
        self.custom = [
            type(m)._replicate_for_data_parallel is not _BASE_REPLICATE
            or type(m).__setattr__ is not nn.Module.__setattr__
            for m in modules
        ]
        # Whether every change to this tree moves mutations.epoch(): then, while it holds
        # still, a call refreshes only tensors (see refresh). A module with its own
        # __setattr__ or replication hook may change without a count: such trees re-check
        # their structure and refill every replica's __dict__ on every call.
        self.trusted = not any(self.custom)
        # The epoch read before the last full sync (set by the cache; None: never trusted).
        self.epoch: int | None = None
        # Raises torch's own error for lazy modules, as torch.nn.parallel.replicate does.
        self.replicas = [[m._replicate_for_data_parallel() for m in modules] for _ in range(n)]
        self.children: list[list[dict[str, nn.Module | None]]] = [
            [
                {
                    k: None if c is None else self.replicas[j][index[id(c)]]
                    for k, c in m._modules.items()
                }
                for m in modules
            ]
            for j in range(n)
        ]
        # Per replica, per module: its own forward-hook and forward-pre-hook tables.
        self.hook_tables: list[list[list[Any]]] = [
            [[OrderedDict(), OrderedDict()] for _ in modules] for _ in range(n)
        ]
        # Private buffers: None where replica j uses the module's own tensor (replica 0 on
        # the buffer's device), else a copy on replica j's device.
        self.private: list[list[torch.Tensor | None]] = []
        for j, device in enumerate(devices):
            row: list[torch.Tensor | None] = []
            for b in self.buffers:
                if j == 0 and _key(b.device) == self.keys[0]:
                    row.append(None)
                else:
                    with torch.no_grad():
                        row.append(b.detach().to(device, copy=True))
            self.private.append(row)
        # Per replica: the buffer slots it holds a private copy of (fixed per replica set).
        self.private_slots: list[list[int]] = [
            [i for i, mine in enumerate(row) if mine is not None] for row in self.private
        ]
        # Parameter copies per target device key: tensors aligned with self.params (None where
        # the parameter lives on that device).
        self.copies: dict[_Key, list[torch.Tensor | None]] = {}
        # Whether each copy is this set's own tensor (refreshed in place in inference) rather
        # than one bound to an autograd graph (replaced on the next call).
        self.copy_keys: dict[_Key, list[bool]] = {}
        for k in dict.fromkeys(self.keys):
            self.copies[k] = [None] * len(self.params)
            self.copy_keys[k] = [False] * len(self.params)
        # Devices are part of the fingerprint, so which copies exist is fixed per set.
        self.param_keys = [_key(p.device) for p in self.params]
        self.targets = [k for k in self.copies if any(pk != k for pk in self.param_keys)]
        # Replica 0 is the module itself when everything it holds lives on replica 0's device:
        # it would share every parameter and buffer anyway, and then needs no re-sync at all.
        # (The module is returned by sync, never stored: the cache holds it only weakly.)
        self.own = all(k == self.keys[0] for k in self.param_keys) and all(
            _key(b.device) == self.keys[0] for b in self.buffers
        )
        # Modules re-synced by the fast path of sync, and the (replica, module) pairs that
        # need the full one.
        self.simple = [
            not (self.custom[i] or self.param_slots[i] or self.buffer_slots[i])
            and not (self.none_params[i] or self.none_buffers[i])
            for i in range(len(modules))
        ]
        # Per replica, the modules that need the full re-sync: (replica, index, its children
        # (None for a custom replication), parameter and buffer names that hold None, names
        # and slots of its parameters and of its buffers).
        self.complex: list[list[tuple[Any, ...]]] = [
            [
                (
                    self.replicas[j][i],
                    i,
                    None if self.custom[i] else self.children[j][i],
                    self.none_params[i],
                    self.none_buffers[i],
                    tuple(name for name, _ in self.param_slots[i]),
                    tuple(slot for _, slot in self.param_slots[i]),
                    tuple(name for name, _ in self.buffer_slots[i]),
                    tuple(slot for _, slot in self.buffer_slots[i]),
                )
                for i, ok in enumerate(self.simple)
                if not ok
            ]
            for j in range(n)
        ]

        # The module's buffers as of the last sync, and per replica the parameter tensors its
        # dictionaries hold (None: none yet).
        self.current: list[torch.Tensor] = list(self.buffers)
        self.installed: list[list[torch.Tensor] | None] = [None] * n

    # -- parameters -------------------------------------------------------------------------

    def _sync_params(self) -> list[list[torch.Tensor]]:
        """Per device key, per parameter slot: the tensor a replica on that device uses."""
        params, targets = self.params, self.targets
        if not targets:  # every replica sits on its parameters' devices: share them all
            return [params] * len(self.keys)  # type: ignore[list-item]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            self._copy_differentiable(targets)
        else:
            self._copy_changed(targets)
        views: dict[_Key, list[torch.Tensor]] = {}
        for k, copies in self.copies.items():
            views[k] = [
                p if pk == k or c is None else c
                for p, pk, c in zip(params, self.param_keys, copies, strict=True)
            ]
        return [views[k] for k in self.keys]

    def _copy_differentiable(self, targets: list[_Key]) -> None:
        params = self.params
        by_source: dict[_Key, list[int]] = {}
        for i, pk in enumerate(self.param_keys):
            by_source.setdefault(pk, []).append(i)
        for source, slots in by_source.items():
            dests = [k for k in targets if k != source]
            if not dests:
                continue
            if source[0] == "cuda" and all(k[0] == "cuda" for k in dests):
                from torch.nn.parallel._functions import Broadcast

                # One coalesced, differentiable broadcast; its backward is a reduce-add onto
                # the source device, as in torch.nn.parallel.replicate.
                indices = [source[1], *(k[1] for k in dests)]
                out = Broadcast.apply(indices, *(params[i] for i in slots))
                n = len(slots)
                for d, k in enumerate(dests, start=1):
                    for s, i in enumerate(slots):
                        self.copies[k][i] = out[d * n + s]
                        self.copy_keys[k][i] = False  # graph-bound: never refreshed in place
            else:
                for k in dests:
                    device = torch.device(*k)
                    for i in slots:
                        self.copies[k][i] = params[i].to(device)
                        self.copy_keys[k][i] = False

    def _copy_changed(self, targets: list[_Key]) -> None:
        """Inference: refresh the copies on other devices from the module's parameters.

        Every call copies (one fused copy into the existing tensors): no cheap test tells that a
        parameter changed, since fused optimizers and ``p.data`` updates do not bump
        ``_version``. A copy is allocated only where none can be reused (none yet, a copy
        bound to an autograd graph, or a new shape or dtype).
        """
        with torch.no_grad():
            for k in targets:
                copies, reusable = self.copies[k], self.copy_keys[k]
                device = torch.device(*k)
                dests: list[torch.Tensor] = []
                sources: list[torch.Tensor] = []
                for i, (p, pk) in enumerate(zip(self.params, self.param_keys, strict=True)):
                    if pk == k:
                        continue
                    c = copies[i]
                    if c is None or not reusable[i] or c.shape != p.shape or c.dtype != p.dtype:
                        copies[i] = p.detach().to(device, copy=True)
                        reusable[i] = True
                    else:
                        dests.append(c)
                        sources.append(p.detach())
                if not dests:
                    continue
                if _FOREACH_COPY is not None:
                    _FOREACH_COPY(dests, sources)
                else:  # pragma: no cover - torch without the fused copy
                    for dest, source in zip(dests, sources, strict=True):
                        dest.copy_(source)

    # -- buffers ----------------------------------------------------------------------------

    def _current_buffers(self, root: nn.Module) -> list[torch.Tensor]:
        """The module's buffers now: one may have been reassigned (same shape) since the build."""
        current = list(self.buffers)
        for i, slots in enumerate(self.buffer_slots):
            if slots:
                bufs = (root if i == 0 else self._source(i))._buffers
                for name, slot in slots:
                    current[slot] = bufs[name]  # type: ignore[assignment]
        return current

    def _source(self, i: int) -> nn.Module:
        return self.sources[i]  # type: ignore[return-value]

    def _sync_buffers(self, buffers: list[torch.Tensor]) -> bool:
        """Re-copy every private buffer; whether one was replaced (a buffer requiring grad,
        copied differentiably), which the replicas' dictionaries must then be told of."""
        grad = torch.is_grad_enabled()
        replaced = False
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for j, device in enumerate(self.devices):
            row = self.private[j]
            for i in self.private_slots[j]:
                b = buffers[i]
                if grad and b.requires_grad:
                    # Differentiable, as torch broadcasts buffers that require grad.
                    row[i] = b.to(device) if _key(b.device) != self.keys[j] else b.clone()
                    replaced = True
                    continue
                dests.append(row[i])  # type: ignore[arg-type]
                sources.append(b)
        if dests:
            # Always: BatchNorm updates running stats without bumping _version, so no cheap
            # test can tell that either side changed. One fused call instead of one per buffer.
            with torch.no_grad():
                if _FOREACH_COPY is not None:
                    _FOREACH_COPY(dests, sources)
                else:  # pragma: no cover - torch without the fused copy
                    for dest, source in zip(dests, sources, strict=True):
                        dest.copy_(source)
        return replaced

    # -- the whole sync ---------------------------------------------------------------------

    def unchanged(self, root: nn.Module) -> bool:
        """Whether ``root``'s structure is still the one these replicas were built for."""
        return signature([root, *self.sources[1:]]) == self.sig  # type: ignore[list-item]

    def sync(self, root: nn.Module) -> list[nn.Module]:
        """Bring every replica in line with the module's current state; return the roots."""
        per_device = self._sync_params()
        buffers = self._current_buffers(root)
        self._sync_buffers(buffers)
        self.current = buffers
        return self._fill(root, per_device, buffers)

    def refresh(self, root: nn.Module) -> list[nn.Module]:
        """``sync`` for a module unchanged since the last sync (``mutations.epoch`` says so).

        Only what changes without a count is brought in line: parameter copies on other
        devices (values; under autograd, new differentiable copies) and private buffer copies
        (BatchNorm writes its statistics in place). The replicas' dictionaries already hold
        everything else, as the last sync left them: a forward that set an attribute on a
        replica counted a change, and the next call takes the full sync.
        """
        per_device = self._sync_params()
        if self._sync_buffers(self.current):  # new differentiable buffer copies: refill
            return self._fill(root, per_device, self.current)
        self._install_params(per_device)
        return self._roots(root)

    def _install_params(self, per_device: list[list[torch.Tensor]]) -> None:
        """Point each replica at the parameter tensors of this call, where they are new."""
        first = 1 if self.own else 0
        for j, records in enumerate(self.complex):
            tensors = per_device[j]
            before = self.installed[j]
            if j < first or not records or before is tensors:
                continue
            if before is not None and all(map(operator.is_, before, tensors)):
                continue
            take_param = tensors.__getitem__
            for rep, _, _, _, _, pnames, pslots, _, _ in records:
                if pnames:
                    attrs = dict(zip(pnames, map(take_param, pslots), strict=True))
                    d = rep.__dict__
                    d["_former_parameters"] = OrderedDict(attrs)
                    d.update(attrs)
            self.installed[j] = tensors

    def _roots(self, root: nn.Module) -> list[nn.Module]:
        replicas = [reps[0] for reps in self.replicas]
        if self.own:
            replicas[0] = root
        return replicas

    def _fill(
        self, root: nn.Module, per_device: list[list[torch.Tensor]], buffers: list[torch.Tensor]
    ) -> list[nn.Module]:
        """Refill every replica's ``__dict__`` from its source module's; return the roots."""
        self.installed = list(per_device)
        sources: list[nn.Module] = [root, *self.sources[1:]]  # type: ignore[list-item]
        # Plain attributes, training flags and hooks: mirrored from the source. Each replica
        # gets a new dictionary (one C-level copy costs less than clearing and refilling the
        # old one) with fresh containers, so nothing a forward does to a replica outlives it.
        dicts = [m.__dict__ for m in sources]
        set_dict = object.__setattr__
        new_od = OrderedDict
        first = 1 if self.own else 0
        for j in range(first, len(self.devices)):
            for rep, src_dict, kids, simple, hooks in zip(
                self.replicas[j],
                dicts,
                self.children[j],
                self.simple,
                self.hook_tables[j],
                strict=True,
            ):
                if simple:  # no parameters, no buffers, no custom hooks: most modules
                    d = src_dict.copy()
                    d["_parameters"] = {}
                    d["_modules"] = kids.copy()
                    d["_is_replica"] = True
                    d["_buffers"] = {}
                    d["_former_parameters"] = new_od()
                    _own_hooks(d, hooks)
                    set_dict(rep, "__dict__", d)
        for j, records in enumerate(self.complex):
            if not records or j < first:
                continue
            tensors = per_device[j]
            take_param = tensors.__getitem__
            private = self.private[j]
            # The buffers replica j uses: the module's own where it has no private copy.
            take_buffer = [
                b if mine is None else mine for b, mine in zip(buffers, private, strict=True)
            ]
            take_buffer_at = take_buffer.__getitem__
            for rep, i, kids, none_params, none_buffers, pnames, pslots, bnames, bslots in records:
                if kids is None:  # a custom replication hook or __setattr__
                    self._sync_custom(j, i, sources[i], tensors, take_buffer)
                    continue
                d = dicts[i].copy()
                d["_parameters"] = dict.fromkeys(none_params) if none_params else {}
                d["_modules"] = kids.copy()
                d["_is_replica"] = True
                if none_buffers:
                    bufs: dict[str, torch.Tensor | None] = dict.fromkeys(none_buffers)
                    bufs.update(zip(bnames, map(take_buffer_at, bslots), strict=True))
                    d["_buffers"] = bufs
                else:
                    d["_buffers"] = dict(zip(bnames, map(take_buffer_at, bslots), strict=True))
                attrs = dict(zip(pnames, map(take_param, pslots), strict=True))
                # torch exposes the copies here for DDP (#33907); harmless elsewhere.
                d["_former_parameters"] = new_od(attrs)
                d.update(attrs)
                _own_hooks(d, self.hook_tables[j][i])
                set_dict(rep, "__dict__", d)
        return self._roots(root)

    def _sync_custom(
        self,
        j: int,
        i: int,
        src: nn.Module,
        tensors: list[torch.Tensor],
        take_buffer: list[torch.Tensor],
    ) -> None:
        """Re-sync replica ``j`` of a module with its own replication hook or ``__setattr__``."""
        rep = self.replicas[j][i]
        d = src._replicate_for_data_parallel().__dict__.copy()
        none_params = self.none_params[i]
        d["_parameters"] = dict.fromkeys(none_params) if none_params else {}
        d["_modules"] = self.children[j][i].copy()
        d["_is_replica"] = True
        bufs: dict[str, torch.Tensor | None] = dict.fromkeys(self.none_buffers[i])
        for name, slot in self.buffer_slots[i]:
            bufs[name] = take_buffer[slot]
        d["_buffers"] = bufs
        pslots = self.param_slots[i]
        attrs: OrderedDict[str, torch.Tensor] = OrderedDict(
            [(name, tensors[slot]) for name, slot in pslots]
        )
        d["_former_parameters"] = attrs
        _own_hooks(d, self.hook_tables[j][i])
        object.__setattr__(rep, "__dict__", d)
        if pslots:
            for name, value in attrs.items():
                setattr(rep, name, value)  # e.g. RNN refreshes its flat weights
            # setattr registers a same-device Parameter: keep replicas free of them.
            rep.__dict__["_parameters"] = dict.fromkeys(none_params) if none_params else {}


def _own_hooks(d: dict[str, Any], mine: list[Any]) -> None:
    """Give a replica's new ``__dict__`` forward-hook tables of its own, equal to its source's.

    A replica's ``__dict__`` is a shallow copy of its source's: without this, a hook registered
    during a replica's forward (lazily, as transformers' output capture does on the first
    ``output_hidden_states=True`` call) would land in the user's module too and fire twice
    from then on (torch's replicate has that flaw). ``mine`` holds the replica's tables between
    calls: while both the source's and the replica's are empty (the usual case) the same empty
    table is reused, otherwise the source's is copied, so the replica always starts a call
    with its source's hooks and nothing it registers outlives the call.
    """
    src = d.get("_forward_hooks")
    if src is not None:
        if src or mine[0]:
            mine[0] = src.copy()
        d["_forward_hooks"] = mine[0]
    src = d.get("_forward_pre_hooks")
    if src is not None:
        if src or mine[1]:
            mine[1] = src.copy()
        d["_forward_pre_hooks"] = mine[1]
