"""The replicas of one module on one device tuple: built once, then kept in step with it.

:class:`Replicas` has four jobs, each in its own part below: build the replica objects for a
structure (one per submodule per device, tied parameters once); tell on each call what changed
(:class:`dataparallel.replicate._check.Snapshot`, local to this tree and complete); sync the tensors
each call (parameters shared or copied, private buffer copies); and refill the dictionaries of
the replicas whose source module was written (attributes, training flags, hooks).

What is synced, and why:

- plain attributes and training flags: a replica's ``__dict__`` is refilled from its source
  module's whenever the snapshot says that module was written (so ``model.scale = 3.0``,
  ``model.eval()`` or ``model._parameters["w"] = p`` is seen at the next call);
- parameters: a replica on a parameter's own device uses the parameter itself (no copy, the
  gradient lands on it directly). On another device, with grad enabled, every call makes fresh
  copies (differentiable ones, torch's ``Broadcast`` between CUDA devices and
  ``param.to(device)`` otherwise, so gradients flow back to the module's own parameters). With
  grad disabled the copies made by an earlier call without grad are refreshed in place, in one
  fused copy (no cheap test can tell a parameter changed: fused optimizers and ``p.data``
  updates do not bump ``_version``);
- buffers: replica 0 uses the module's own buffers when it sits on their device, so BatchNorm
  running statistics update exactly as in torch, from replica 0's chunk; every other replica
  has private copies, written in place while nothing else holds them, else made anew.

Copy on write: a tensor that an autograd graph may have saved is never overwritten. Parameter
copies: only calls with grad enabled build graphs, and they always get new copies; the copies
refreshed in place were made, and have only been used, by calls without grad (in the same
mode: inference tensors stay inference tensors). Buffer copies: a graph that saved one holds
a reference to it (``Tensor._use_count`` above 1) until backward frees the graph. So two calls
then one backward, ``max_size`` waves, BatchNorm in ``eval()`` and buffers used as factors all
differentiate what their own call saw.

Compiled submodules: ``torch.compile(child)`` (an ``OptimizedModule``) is looked through, and
a child compiled in place (``child.compile()``) loses its compiled call on the replicas: each
replica runs its own eager copy, replica 0 (the module itself) the compiled one, with a warning
once per replica set. Nothing here writes the user's modules.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dataparallel._warn import warn_user
from dataparallel.replicate._check import Snapshot, fingerprint, signature
from dataparallel.replicate._compiled import check_not_compiled, compiled_class

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
    parameter and buffer strongly, which keeps the fingerprint's ids valid. Not thread-safe: a
    wrapper serialises its calls, and ``dp.replicate``'s callers share one set per module.
    """

    def __init__(self, root: nn.Module, devices: tuple[torch.device, ...]) -> None:
        check_not_compiled(root, devices)
        modules, sig = fingerprint(root)
        self.sig = sig
        self.sources: list[nn.Module | None] = [None, *modules[1:]]
        self.devices = devices
        self.keys = [_key(d) for d in devices]
        index = {id(m): i for i, m in enumerate(modules)}
        n = len(devices)
        self.fills = 0  # how many times the dictionaries were refilled (the table re-checks)
        self.refilled: list[int] = []  # the modules the last refill was for

        # torch.compile(child) wraps the child in an OptimizedModule whose compiled forward is
        # bound to the user's child: the replicas look through it to the child's own replica.
        optimized = compiled_class()
        self.through = {
            i: index[id(m.__dict__["_modules"]["_orig_mod"])]
            for i, m in enumerate(modules)
            if optimized is not None
            and isinstance(m, optimized)
            and isinstance(m.__dict__["_modules"].get("_orig_mod"), nn.Module)
        }
        self.compiled_seen = False  # whether the eager-replica warning was given
        if self.through and n > 1:
            inner = modules[next(iter(self.through.values()))]
            self._warn_compiled(f"torch.compile({type(inner).__name__})")

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
        # Raises torch's own error for lazy modules, as torch.nn.parallel.replicate does. An
        # OptimizedModule gets no replica of its own: its slot holds its child's.
        self.replicas: list[list[nn.Module]] = []
        for _ in range(n):
            row = [
                m if i in self.through else m._replicate_for_data_parallel()
                for i, m in enumerate(modules)
            ]
            for i, orig in self.through.items():
                row[i] = row[orig]
            self.replicas.append(row)
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
        # Per replica, per module: its own hook tables (see _own_hooks).
        self.hook_tables: list[list[list[Any]]] = [
            [[None] * len(_HOOK_TABLES) for _ in modules] for _ in range(n)
        ]
        # Private buffers: None where replica j uses the module's own tensor (replica 0 on
        # the buffer's device), else a copy on replica j's device, made by _sync_buffers.
        self.private: list[list[torch.Tensor | None]] = [
            [None if j == 0 and _key(b.device) == self.keys[0] else _NOT_YET for b in self.buffers]
            for j in range(n)
        ]
        # Per replica: the buffer slots it holds a private copy of (fixed per replica set).
        self.private_slots: list[list[int]] = [
            [i for i, mine in enumerate(row) if mine is not None] for row in self.private
        ]
        # Parameter copies per target device key: tensors aligned with self.params (None where
        # the parameter lives on that device), and the grad mode each may be refreshed in
        # place under (None: never).
        self.copies: dict[_Key, list[torch.Tensor | None]] = {}
        self.copy_mode: dict[_Key, list[str | None]] = {}
        for k in dict.fromkeys(self.keys):
            self.copies[k] = [None] * len(self.params)
            self.copy_mode[k] = [None] * len(self.params)
        # Devices are part of the fingerprint, so which copies exist is fixed per set.
        self.param_keys = [_key(p.device) for p in self.params]
        self.targets = [k for k in self.copies if any(pk != k for pk in self.param_keys)]
        # Replica 0 is the module itself when everything it holds lives on replica 0's device:
        # it would share every parameter and buffer anyway, and then needs no re-sync at all.
        # (The module is returned by sync, never stored: the cache holds it only weakly.)
        self.own = all(k == self.keys[0] for k in self.param_keys) and all(
            _key(b.device) == self.keys[0] for b in self.buffers
        )
        # Modules re-synced by the fast path of _fill, and the (replica, module) pairs that
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
                if not ok and i not in self.through
            ]
            for j in range(n)
        ]

        # The module's buffers as of the last sync; per replica the parameter and buffer
        # tensors its dictionaries hold (None: to be installed); what the last fill saw.
        self.current: list[torch.Tensor] = list(self.buffers)
        self.installed: list[tuple[list[torch.Tensor], list[torch.Tensor]] | None] = [None] * n
        # (inference mode, the buffers list, copies, sources) when every private copy was
        # written or made in place by the last sync: the next one, in the same mode and with
        # no graph holding a copy, is one fused copy.
        self.ready: tuple[bool, list[torch.Tensor], list[Any], list[torch.Tensor]] | None = None
        self.snapshot: Snapshot | None = None

    # -- what changed ---------------------------------------------------------------------------

    def current_replicas(self, root: nn.Module) -> list[nn.Module] | None:
        """The replicas, in line with ``root`` now; ``None`` when its structure changed (the
        caller builds a new set).

        Nothing written since the last call: tensors only. Some module written: its replicas'
        dictionaries are refilled (all of them on the first call).
        """
        snapshot = self.snapshot
        if snapshot is not None and snapshot.same():
            return self._refresh(root)
        check_not_compiled(root, self.devices)  # root.compile() since the last call
        if not self.unchanged(root):
            return None
        modules: list[nn.Module] = [root, *self.sources[1:]]  # type: ignore[list-item]
        if snapshot is None:
            replicas = self.sync_once(root)
            self.snapshot = Snapshot(modules)
        else:
            self.refilled = snapshot.changed()
            replicas = self._sync(root, self.refilled)
            snapshot.retake(modules, self.refilled)
        return replicas

    def sync_once(self, root: nn.Module) -> list[nn.Module]:
        """The first sync of a new set, with no snapshot kept (``fresh_replicate``)."""
        self.refilled = list(range(len(self.sources)))
        return self._sync(root, None)

    def unchanged(self, root: nn.Module) -> bool:
        """Whether ``root``'s structure is still the one these replicas were built for."""
        return signature([root, *self.sources[1:]]) == self.sig  # type: ignore[list-item]

    # -- parameters -------------------------------------------------------------------------

    def _sync_params(self) -> list[list[torch.Tensor]]:
        """Per device key, per parameter slot: the tensor a replica on that device uses."""
        params, targets = self.params, self.targets
        if not targets:  # every replica sits on its parameters' devices: share them all
            return [params] * len(self.keys)  # type: ignore[list-item]
        mode = _mode()
        if mode is None:
            self._copy_fresh(targets)
        else:
            self._copy_in_place(targets, mode)
        views: dict[_Key, list[torch.Tensor]] = {}
        for k, copies in self.copies.items():
            views[k] = [
                p if pk == k or c is None else c
                for p, pk, c in zip(params, self.param_keys, copies, strict=True)
            ]
        return [views[k] for k in self.keys]

    def _copy_fresh(self, targets: list[_Key]) -> None:
        """Grad enabled: new copies, differentiable, that no later call ever writes."""
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
                        self.copy_mode[k][i] = None  # graph-bound: never refreshed in place
            else:
                for k in dests:
                    device = torch.device(*k)
                    for i in slots:
                        self.copies[k][i] = _copy_to(params[i], device)
                        self.copy_mode[k][i] = None

    def _copy_in_place(self, targets: list[_Key], mode: str) -> None:
        """Grad disabled: refresh the copies on other devices from the module's parameters.

        Every call copies (one fused copy into the existing tensors): no cheap test tells that a
        parameter changed, since fused optimizers and ``p.data`` updates do not bump
        ``_version``. A copy is written in place only when a call in this same mode made it
        (no graph can hold it); otherwise a new one is made.
        """
        with torch.no_grad():
            for k in targets:
                copies, modes = self.copies[k], self.copy_mode[k]
                device = torch.device(*k)
                dests: list[torch.Tensor] = []
                sources: list[torch.Tensor] = []
                for i, (p, pk) in enumerate(zip(self.params, self.param_keys, strict=True)):
                    if pk == k:
                        continue
                    c = copies[i]
                    if c is None or modes[i] != mode or c.shape != p.shape or c.dtype != p.dtype:
                        copies[i] = _copy_to(p.detach(), device)
                        modes[i] = mode
                    else:
                        dests.append(c)
                        sources.append(p.detach())
                _copy_all(dests, sources)

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

    def _sync_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Bring every private buffer copy in line with the module's buffers.

        A copy is written in place only when nothing but this set holds it: its tensor's use
        count is 1, so no autograd graph saved it (BatchNorm in ``eval()`` and a buffer used as
        a factor are saved; ``Tensor._use_count`` drops back once the graph is freed). Else a
        new copy is made. A buffer that requires grad is copied differentiably on every call
        with grad enabled, as torch broadcasts it. The writes are one fused copy: BatchNorm
        updates running statistics without bumping ``_version``, so no cheap test can tell
        that either side changed.
        """
        mode = _mode()
        inference = mode == "inference"
        ready = self.ready
        if (
            ready is not None
            and ready[0] == inference
            and ready[1] is buffers
            and max(map(_USE_COUNT, ready[2]), default=1) == 1
        ):
            try:  # every copy free to write, as the last call left them
                _copy_all(ready[2], ready[3])
                return
            except RuntimeError:  # a buffer's shape changed through .data: the careful path
                pass
        self.ready = None
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        reusable = True
        with torch.no_grad():
            for j, device in enumerate(self.devices):
                row = self.private[j]
                for i in self.private_slots[j]:
                    b = buffers[i]
                    mine = row[i]
                    if mode is None and b.requires_grad:
                        with torch.enable_grad():
                            row[i] = _copy_to(b, device)
                        reusable = False
                    elif (
                        mine is _NOT_YET
                        or mine is None
                        or mine.is_inference() != inference
                        or mine.shape != b.shape
                        or mine.dtype != b.dtype
                        or _USE_COUNT(mine) != 1
                    ):
                        row[i] = _copy_to(b.detach(), device)
                    else:
                        dests.append(mine)
                        sources.append(b.detach())
            _copy_all(dests, sources)
        if reusable:
            # Next time, in this mode, on these buffers: one fused copy and nothing else.
            pairs = [
                (row[i], buffers[i])
                for row, slots in zip(self.private, self.private_slots, strict=True)
                for i in slots
            ]
            self.ready = (inference, buffers, [a for a, _ in pairs], [b.detach() for _, b in pairs])

    def _buffers_of(self, j: int, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers replica ``j`` uses: the module's own where it has no private copy."""
        return [
            b if mine is None else mine for b, mine in zip(buffers, self.private[j], strict=True)
        ]

    # -- the whole sync ---------------------------------------------------------------------

    def _sync(self, root: nn.Module, only: list[int] | None) -> list[nn.Module]:
        """Bring every replica in line with the module's current state; return the roots.

        ``only``: the modules whose dictionaries must be refilled (``None``: all of them).
        """
        per_device = self._sync_params()
        buffers = self._current_buffers(root)
        self._sync_buffers(buffers)
        self.current = buffers
        self._fill(root, buffers, only)
        self.fills += 1
        self.installed = [None] * len(self.devices)
        self._install(root, per_device)
        return self._roots(root)

    def _refresh(self, root: nn.Module) -> list[nn.Module]:
        """``_sync`` for a module not written since the last call (the snapshot says so).

        Only what changes without a write is brought in line: parameter copies on other
        devices and private buffer copies (values, or new tensors with grad enabled).
        """
        per_device = self._sync_params()
        self._sync_buffers(self.current)
        self._install(root, per_device)
        return self._roots(root)

    def _install(self, root: nn.Module, per_device: list[list[torch.Tensor]]) -> None:
        """Point each replica at this call's parameter and buffer tensors, where they are new."""
        first = 1 if self.own else 0
        for j, records in enumerate(self.complex):
            if j < first or not records:
                continue
            tensors = per_device[j]
            buffers = self._buffers_of(j, self.current)
            before = self.installed[j]
            new_params = before is None or not (
                before[0] is tensors or all(map(operator.is_, before[0], tensors))
            )
            new_buffers = before is None or not all(map(operator.is_, before[1], buffers))
            if not (new_params or new_buffers):
                continue
            take_param = tensors.__getitem__
            take_buffer = buffers.__getitem__
            for rep, i, kids, _, _, pnames, pslots, bnames, bslots in records:
                if kids is None:  # a custom replication hook or __setattr__
                    self._sync_custom(j, i, self._source_or_root(i, root), tensors, buffers)
                    continue
                d = rep.__dict__
                if pnames and new_params:
                    attrs = dict(zip(pnames, map(take_param, pslots), strict=True))
                    # torch exposes the copies here for DDP (#33907); harmless elsewhere.
                    d["_former_parameters"] = OrderedDict(attrs)
                    d.update(attrs)
                if bnames and new_buffers:
                    d["_buffers"].update(zip(bnames, map(take_buffer, bslots), strict=True))
            self.installed[j] = (tensors, buffers)

    def _source_or_root(self, i: int, root: nn.Module) -> nn.Module:
        return root if i == 0 else self._source(i)

    def _roots(self, root: nn.Module) -> list[nn.Module]:
        replicas = [reps[0] for reps in self.replicas]
        if self.own:
            replicas[0] = root
        return replicas

    def _fill(self, root: nn.Module, buffers: list[torch.Tensor], only: list[int] | None) -> None:
        """Refill the replicas' ``__dict__``s of the modules in ``only`` (all when ``None``)
        from their sources': plain attributes, training flags, hooks, children.

        Each replica gets a new dictionary (one C-level copy costs less than clearing and
        refilling the old one) with fresh tables, so nothing a forward does to a replica
        outlives it. Parameters and buffers are put in by ``_install``.
        """
        sources: list[nn.Module] = [root, *self.sources[1:]]  # type: ignore[list-item]
        dicts = [m.__dict__ for m in sources]
        wanted = None if only is None else set(only)
        set_dict = object.__setattr__
        new_od = OrderedDict
        first = 1 if self.own else 0
        for j in range(first, len(self.devices)):
            for i, (rep, src_dict, kids, simple, hooks) in enumerate(
                zip(
                    self.replicas[j],
                    dicts,
                    self.children[j],
                    self.simple,
                    self.hook_tables[j],
                    strict=True,
                )
            ):
                if not simple or i in self.through or (wanted is not None and i not in wanted):
                    continue
                # no parameters, no buffers, no custom hooks: most modules
                d = src_dict.copy()
                d["_parameters"] = {}
                d["_modules"] = kids.copy()
                d["_is_replica"] = True
                d["_buffers"] = {}
                d["_former_parameters"] = new_od()
                self._own_state(d, hooks, sources[i])
                set_dict(rep, "__dict__", d)
        for j, records in enumerate(self.complex):
            if not records or j < first:
                continue
            private = self._buffers_of(j, buffers)
            for rep, i, kids, none_params, none_buffers, _, _, bnames, bslots in records:
                if kids is None or (wanted is not None and i not in wanted):
                    continue  # custom modules are re-synced by _install
                d = dicts[i].copy()
                d["_parameters"] = dict.fromkeys(none_params) if none_params else {}
                d["_modules"] = kids.copy()
                d["_is_replica"] = True
                bufs: dict[str, torch.Tensor | None] = dict.fromkeys(none_buffers)
                bufs.update(zip(bnames, map(private.__getitem__, bslots), strict=True))
                d["_buffers"] = bufs
                d["_former_parameters"] = new_od()
                self._own_state(d, self.hook_tables[j][i], sources[i])
                set_dict(rep, "__dict__", d)

    def _own_state(self, d: dict[str, Any], hooks: list[Any], source: nn.Module) -> None:
        """What a replica's new ``__dict__`` must not share with its source's."""
        _own_hooks(d, hooks)
        if d.get("_compiled_call_impl") is not None:
            # module.compile(): the compiled call is bound to the user's module; the replica
            # runs its own forward, eagerly.
            d["_compiled_call_impl"] = None
            self._warn_compiled(type(source).__name__)

    def _warn_compiled(self, what: str) -> None:
        if self.compiled_seen:
            return
        self.compiled_seen = True
        warn_user(
            f"module: a compiled submodule ({what}) is replicated as its eager module: replica 0 "
            f"(the module itself) runs it compiled, replicas 1 to {len(self.devices) - 1} run "
            f"their own copies eagerly; to compile every replica, compile the wrapper instead: "
            f"torch.compile(dp.DataParallel(model))"
        )

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
        self._own_state(d, self.hook_tables[j][i], src)
        object.__setattr__(rep, "__dict__", d)
        if pslots:
            for name, value in attrs.items():
                setattr(rep, name, value)  # e.g. RNN refreshes its flat weights
            # setattr registers a same-device Parameter: keep replicas free of them.
            rep.__dict__["_parameters"] = dict.fromkeys(none_params) if none_params else {}


# A private buffer copy not made yet (the first sync makes it).
_NOT_YET: Any = object()

# The hook tables a replica holds its own copy of: a hook registered during a replica's forward
# (lazily, as transformers' output capture does) must land once, on the module, through
# replica 0, as on one device.
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)


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


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor with ``tensor``'s value on ``device`` (differentiable where it requires
    grad). On the tensor's own device (``"cpu:1"`` is the CPU) a clone, which costs half of
    ``.to(device, copy=True)``'s dispatch."""
    here = tensor.device
    if here.type == device.type and (here.type == "cpu" or here.index == device.index):
        return tensor.clone()
    return tensor.to(device, copy=True)


def _copy_all(dests: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if not dests:
        return
    with torch.no_grad():
        if _FOREACH_COPY is not None:
            _FOREACH_COPY(dests, sources)
        else:  # pragma: no cover - torch without the fused copy
            for dest, source in zip(dests, sources, strict=True):
                dest.copy_(source)


def _own_hooks(d: dict[str, Any], mine: list[Any]) -> None:
    """Give a replica's new ``__dict__`` hook tables of its own, equal to its source's.

    A replica's ``__dict__`` is a shallow copy of its source's: without this, a hook registered
    during a replica's forward would land in the user's module too and fire twice from then on
    (torch's replicate has that flaw). ``mine`` holds the replica's tables between fills: while
    both the source's and the replica's are empty (the usual case) the same empty table is
    reused, otherwise the source's is copied, so the replica always starts with its source's
    hooks and nothing it registers outlives the next fill.
    """
    for k, name in enumerate(_HOOK_TABLES):
        src = d.get(name)
        if src is None:
            continue
        if src or mine[k] is None or mine[k]:
            mine[k] = src.copy()
        d[name] = mine[k]
