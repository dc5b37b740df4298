"""The replicas of one module on one device tuple: built once, then kept in step with it.

:class:`Replicas` has four jobs: build the replica objects for a structure (one per submodule
per device, tied parameters once); tell on each call what changed (``_check.Snapshot``, local
to this tree and complete); sync the tensors each call (parameters shared or copied, private
buffer copies: its base class, ``_sync.TensorSync``); and refill the dictionaries of the
replicas whose source module was written, or that their own forward wrote (``_own``). What it
keeps is a tree of records (``_records``: a ``Source`` per module, a ``Replica`` per device, a
``Node`` per replica of a module, a ``Target`` per device the parameters are used on), so no
two lists have to stay aligned by position.

What is synced, and why:

- plain attributes and training flags: a replica's ``__dict__`` is refilled from its source
  module's whenever the snapshot says that module was written (so ``model.scale = 3.0``,
  ``model.eval()`` or ``model._parameters["w"] = p`` is seen at the next call); what in it is
  bound to a module of the tree (an instance ``forward``, a bound-method hook) is rebound to
  the replica (``_rebind``);
- parameters and buffers: see ``_sync`` (shared where they live, else copied; never
  overwritten under a live graph).

Compiled submodules: ``torch.compile(child)`` (an ``OptimizedModule``) is looked through, and
a child compiled in place (``child.compile()``) loses its compiled call on the replicas: each
replica runs its own eager copy, replica 0 (the module itself) the compiled one, with a warning
once per replica set. Nothing here writes the user's modules.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from dataparallel._common.warn import warn_user
from dataparallel.replicate._check import Snapshot, fingerprint, moved_data_only, structure_key
from dataparallel.replicate._compiled import check_not_compiled, compiled_class, eager_message
from dataparallel.replicate._custom import copy_slots, sync_custom
from dataparallel.replicate._kinds import slot_names
from dataparallel.replicate._own import OwnWrites
from dataparallel.replicate._rebind import (
    HOOKS_SEEN,
    SERIAL,
    Rebinding,
    rebind_state,
    replica_zero_grad,
    serial_mark,
)
from dataparallel.replicate._records import (
    NOT_YET,
    Key,
    Node,
    ParameterTable,
    Ready,
    Replica,
    Source,
    Target,
    buffer_table,
    device_key,
    own_hooks,
    tensor_slots,
)
from dataparallel.replicate._sync import TensorSync
from dataparallel.replicate._written import WRITES, ForwardWrites

__all__ = ["Kept", "Replicas"]

# ``Replicas.kept``'s answer: the replicas, their serial mark, whether they hold a SyncBatchNorm.
Kept = tuple[list[nn.Module], str | None, bool]

_BASE_REPLICATE = nn.Module._replicate_for_data_parallel


class Replicas(TensorSync):
    """The replica objects of one module on one device tuple, and what re-syncs them.

    Holds the root module only weakly (it is the side table's key); every other source module,
    parameter and buffer strongly, which keeps the fingerprint's ids valid. Not thread-safe: a
    wrapper serialises its calls, and ``dp.replicate``'s callers share one set per module.
    """

    def __init__(self, root: nn.Module, devices: tuple[torch.device, ...]) -> None:
        check_not_compiled(root, devices)
        modules, structure = fingerprint(root)
        self.structure = structure
        self.tree = modules[1:]  # the source modules after the root, in preorder
        self.devices = devices
        self.fills = 0  # how many times the dictionaries were refilled (the table re-checks)
        self.refilled: list[int] = []  # the modules the last refill was for
        index = {id(m): i for i, m in enumerate(modules)}

        # torch.compile(child) wraps the child in an OptimizedModule whose compiled forward is
        # bound to the user's child: the replicas look through it to the child's own replica.
        optimized = compiled_class()
        self.sources: list[Source] = []
        for i, m in enumerate(modules):
            inner = m.__dict__["_modules"].get("_orig_mod") if optimized is not None else None
            wraps = optimized is not None and isinstance(m, optimized)
            through = index[id(inner)] if wraps and isinstance(inner, nn.Module) else None
            self.sources.append(Source(i, None if i == 0 else m, through))
        self.compiled_seen = False  # whether the eager-replica warning was given
        self.rebinding = Rebinding()  # what each replica's __dict__ rebinds to the replica
        self.hooks_seen: list[Any] = []  # the forward hooks at the last fill (identities)
        wrapped = [s.through for s in self.sources if s.through is not None]
        if wrapped and len(devices) > 1:
            self._warn_compiled(f"torch.compile({type(modules[wrapped[0]]).__name__})")

        self.params: list[nn.Parameter] = []
        self.buffers: list[torch.Tensor] = []
        param_index: dict[int, int] = {}
        buffer_index: dict[int, int] = {}
        for source, m in zip(self.sources, modules, strict=True):
            source.param_names, source.param_slots, source.none_params = tensor_slots(
                m._parameters, self.params, param_index
            )
            source.buffer_names, source.buffer_slots, source.none_buffers = tensor_slots(
                m._buffers, self.buffers, buffer_index
            )
            # Custom replication hooks (RNN's flat weights, fx.GraphModule) or a custom
            # __setattr__ are honoured on every sync; plain modules take the fast path.
            source.custom = (
                type(m)._replicate_for_data_parallel is not _BASE_REPLICATE
                or type(m).__setattr__ is not nn.Module.__setattr__
            )
            source.plain = not (
                source.custom
                or source.param_slots
                or source.buffer_slots
                or source.none_params
                or source.none_buffers
            )
        self.with_buffers = [s for s in self.sources if s.buffer_slots]
        # id -> each parameter, its device, dtype and shape: data that only moved (``p.data =
        # t``, same placement) is followed without a rebuild (``moved_data_only``)
        self.placed = {id(p): (p, p.device, p.dtype, p.shape) for p in self.params}

        # Raises torch's own error for lazy modules, as torch.nn.parallel.replicate does. An
        # OptimizedModule gets no replica of its own: its node holds its child's.
        key0 = device_key(devices[0])
        self.replicas: list[Replica] = []
        for j, device in enumerate(devices):
            objects = [
                m if s.through is not None else m._replicate_for_data_parallel()
                for s, m in zip(self.sources, modules, strict=True)
            ]
            for s in self.sources:
                if s.through is not None:
                    objects[s.index] = objects[s.through]
            nodes = [Node(obj, s) for obj, s in zip(objects, self.sources, strict=True)]
            for node, m in zip(nodes, modules, strict=True):
                node.children = {
                    k: None if c is None else objects[index[id(c)]] for k, c in m._modules.items()
                }
            # Private buffers: a copy on this replica's device, made by _sync_buffers, except
            # for replica 0's buffers on its own device (it uses the module's own).
            private = [
                None if j == 0 and device_key(b.device) == key0 else NOT_YET for b in self.buffers
            ]
            self.replicas.append(Replica(device, nodes, private))

        # Parameter tensors per device; which need copies is fixed per set (devices are part of
        # the fingerprint).
        self.views = {r.key: Target(r.key, self.params) for r in self.replicas}
        self.targets = [t for t in self.views.values() if t.remote]
        self.by_source: dict[Key, list[int]] = {}
        for i, p in enumerate(self.params):
            self.by_source.setdefault(device_key(p.device), []).append(i)
        # Replica 0 is the module itself when everything it holds lives on replica 0's device:
        # it would share every parameter and buffer anyway, and then needs no re-sync at all.
        # (The module is returned by sync, never stored: the cache holds it only weakly.)
        self.own = not self.views[key0].remote and all(
            device_key(b.device) == key0 for b in self.buffers
        )
        self.first = 1 if self.own else 0  # the first replica that is synced
        ps = [(j, n) for j, r in enumerate(self.replicas) for n in r.nodes if j >= self.first]
        self.filled = [(j, n) for j, n in ps if n.source.through is None and not n.source.custom]
        self.copies = bool(self.targets or self.buffers)  # (a copy to refresh on every call)

        # The module's buffers as of the last sync, the fused buffer copy the next sync may
        # take, and what the last fill saw.
        self.current: list[torch.Tensor] = list(self.buffers)
        self.ready: Ready | None = None
        self.snapshot: Snapshot | None = None
        self.stale = False  # every replica's dictionary to be refilled at the next sync
        # What the replicas' own forwards wrote on themselves: refilled at the next sync.
        self.own_writes = OwnWrites()
        self.myself = weakref.ref(self)  # (``check_writes`` calls ``after_call`` through it)
        # ``kept``'s answer, and the snapshot it holds with (``None``: none held, a new sync)
        self.answer: Kept | None = None
        self.warm: Snapshot | None = None
        # Whether the replicas meet at a SyncBatchNorm rendezvous: fixed with the classes.
        built = [n.module for r in self.replicas for n in r.nodes]
        self.syncbn = any(isinstance(m, nn.SyncBatchNorm) for m in [*modules, *built])
        # Shared parameters that forward writes (a momentum encoder): private copies for the
        # replicas after the first, so each call writes them once (``_written``).
        self.writes = ForwardWrites(self.params)
        # Modules whose class declares __slots__: their values live outside __dict__, so
        # every sync copies them to the replicas (a refill copies only the __dict__).
        self.slotted = [
            (i, names)
            for i, m in enumerate(modules)
            if self.sources[i].through is None and (names := slot_names(type(m)))
        ]

    # -- what changed ---------------------------------------------------------------------------

    def modules(self, root: nn.Module) -> list[nn.Module]:
        """The source tree in preorder, ``root`` first."""
        return [root, *self.tree]

    def current_replicas(self, root: nn.Module) -> list[nn.Module] | None:
        """The replicas, in line with ``root`` now; ``None`` when its structure changed (the
        caller builds a new set).

        Nothing written since the last call: tensors only. Some module written: its replicas'
        dictionaries are refilled (all of them on the first call).
        """
        snapshot = self.snapshot
        stale, self.stale = self.stale, False
        written = self.own_writes.written()  # (by the replicas alone: nothing to search)
        if snapshot is not None and snapshot.same() and self.rebinding.same():
            if not (stale or written):
                self._refresh(root)
                return self._roots(root)
            self.refilled = []  # (nothing to search again: the module was not written)
            return self._sync(root, None if stale else written, search=[])
        check_not_compiled(root, self.devices)  # root.compile() since the last call
        if not self.unchanged(root):
            return None
        modules = self.modules(root)
        if snapshot is None:
            replicas = self.sync_once(root)
            self.snapshot = Snapshot(modules, storage=bool(self.targets or self.buffers))
            self.own_writes.take()
        else:
            # a module written, or a holder its replicas copied (a list of submodules)
            self.refilled = sorted({*snapshot.changed(), *self.rebinding.changed()})
            # every dictionary where stale, else those and the replicas' own writes; the
            # written modules searched again
            only = None if stale else sorted({*self.refilled, *written})
            replicas = self._sync(root, only, search=self.refilled)
            snapshot.retake(modules, self.refilled)
        return replicas

    def kept(self, root: nn.Module) -> Kept | None:
        """:meth:`current_replicas` for an owner holding ``root``, with their serial mark and
        ``syncbn``: one answer, kept from one sync to the next (only a fill marks them), read
        as it is while nothing is written. ``None`` when the structure changed."""
        snapshot, rebinding = self.warm, self.rebinding
        if (
            snapshot is not None
            and snapshot.same()
            and (not rebinding.watched or rebinding.same())
            and not self.own_writes.written()
        ):
            if self.slotted:  # (``_refresh``, inlined)
                copy_slots(self.modules(root), self.slotted, self.replicas[self.first :])
            if self.copies or self.writes.arm():
                self._resync(root)
            return self.answer
        replicas = self.current_replicas(root)
        if replicas is None:
            return None
        self.answer = (replicas, serial_mark(replicas), self.syncbn)
        self.warm = self.snapshot
        return self.answer

    def after_call(self, ran: bool) -> None:
        """Right after the replicas ran (``check_writes``; ``ran``: replica 0 among them, not
        a later wave alone): ``OwnWrites.after``."""
        self.own_writes.after(self.snapshot, self.replicas, ran, self.rebinding.keys, self.own)

    def refill(self) -> None:
        """Have the next sync refill every replica's dictionary from its module (a later
        wave's under ``max_size``, whose copies' writes are dropped). The module's own state
        is as the snapshot says; what the search found in it stands unless it was written."""
        self.stale = True
        self.warm = None

    def sync_once(self, root: nn.Module) -> list[nn.Module]:
        """The first sync of a new set, with no snapshot kept (``fresh_replicate``)."""
        self.refilled = list(range(len(self.sources)))
        return self._sync(root, None)

    def unchanged(self, root: nn.Module) -> bool:
        """Whether ``root``'s structure is still the one these replicas were built for."""
        key = structure_key(self.modules(root))
        if key == self.structure:
            return True
        if not moved_data_only(self.structure, key, self.placed):
            return False
        self.structure = key
        return True

    # -- the whole sync ---------------------------------------------------------------------

    def _sync(
        self, root: nn.Module, only: list[int] | None, search: list[int] | None = None
    ) -> list[nn.Module]:
        """Bring every replica in line with the module's current state; return the roots.

        ``only``: the modules whose dictionaries must be refilled (``None``: all of them);
        ``search``: those whose holdings are searched again (``None``: those of ``only``).
        """
        per_device = self.writes.private(self._sync_params())
        buffers = self._current_buffers(root)
        self._sync_buffers(buffers)
        self.current = buffers
        self._fill(root, buffers, only, search)
        if self.slotted:
            copy_slots(self.modules(root), self.slotted, self.replicas[self.first :])
        self.fills, self.warm = self.fills + 1, None  # (a fill may mark them: ``kept``)
        for replica in self.replicas:
            replica.params_in = replica.buffers_in = None
        self._install(root, per_device, filled=True)
        return self._roots(root)

    def _refresh(self, root: nn.Module) -> None:
        """``_sync`` for a module not written since the last call (the snapshot says so).

        Only what changes without a write is brought in line: parameter copies on other
        devices and private buffer copies (values, or new tensors with grad enabled). A set
        whose replicas share every parameter and hold no buffer (every CPU list of a model
        without buffers) has nothing of the kind: its replicas were installed with the
        parameters themselves, which a write past the snapshot's notice cannot replace.
        """
        if self.slotted:
            copy_slots(self.modules(root), self.slotted, self.replicas[self.first :])
        if self.copies or self.writes.arm():
            self._resync(root)

    def _resync(self, root: nn.Module) -> None:
        """``_refresh``'s tensors: parameter copies, private buffer copies, clones."""
        per_device = self.writes.private(self._sync_params())
        self._sync_buffers(self.current)
        self._install(root, per_device)

    def _install(
        self, root: nn.Module, per_device: list[list[torch.Tensor]], filled: bool = False
    ) -> None:
        """Point each replica at this call's parameter and buffer tensors, where they are new;
        then take what the replicas hold as the state their forwards start from (``filled``:
        their dictionaries were refilled too)."""
        wrote = filled
        for replica, tensors in zip(self.replicas, per_device, strict=True):
            full = replica.full
            if not full or (replica is self.replicas[0] and self.own):
                continue
            buffers = replica.buffers(self.current)
            before, before_buffers = replica.params_in, replica.buffers_in
            new_params = before is None or not (
                before is tensors or all(map(operator.is_, before, tensors))
            )
            new_buffers = before_buffers is None or not all(
                map(operator.is_, before_buffers, buffers)
            )
            if not (new_params or new_buffers):
                continue
            wrote = True
            take_param = tensors.__getitem__
            take_buffer = buffers.__getitem__
            for node in full:
                s = node.source
                if s.custom:  # a custom replication hook or __setattr__
                    sync_custom(root, replica, node, tensors, buffers, self)
                    continue
                d = node.module.__dict__
                if s.param_names and new_params:
                    attrs = dict(zip(s.param_names, map(take_param, s.param_slots), strict=True))
                    # torch exposes the copies here for DDP (#33907); harmless elsewhere.
                    d["_former_parameters"] = OrderedDict(attrs)
                    # Attributes, so ``self.weight`` resolves without ``__getattr__``; and
                    # ``_parameters``, so ``self.parameters()`` and ``state_dict()`` inside
                    # forward see this replica's tensors (torch's replicas list none).
                    d.update(attrs)
                    dict.update(d["_parameters"], attrs)  # (both at once: not item by item)
                if s.buffer_names and new_buffers:
                    d["_buffers"].update(
                        zip(s.buffer_names, map(take_buffer, s.buffer_slots), strict=True)
                    )
            # A holder of the tree's parameters or buffers (a custom module's are its own)
            holders = [i for i in self.rebinding.tensors if not self.sources[i].custom]
            if holders:
                own = dict(zip(map(id, self.params), tensors, strict=True))
                own.update(zip(map(id, self.current), buffers, strict=True))
                self.rebinding.bind_tensors(
                    self.modules(root), [n.module for n in replica.nodes], holders, own
                )
            replica.params_in, replica.buffers_in = tensors, buffers
        if wrote and self.snapshot is not None:
            self.own_writes.take()

    def _roots(self, root: nn.Module) -> list[nn.Module]:
        replicas = [r.nodes[0].module for r in self.replicas]
        if self.own:
            replicas[0] = root
        return replicas

    def _fill(
        self,
        root: nn.Module,
        buffers: list[torch.Tensor],
        only: list[int] | None,
        search: list[int] | None = None,
    ) -> None:
        """Refill the replicas' ``__dict__``s of the modules in ``only`` (all when ``None``)
        from their sources': plain attributes, training flags, hooks, children; the rebinding
        search reads again those of ``search`` (``None``: those of ``only``; ``Rebinding.plan``).

        Each replica's dictionary and tables are cleared and refilled in place, so nothing a
        forward did to a replica outlives the fill, and the watch of what the replicas' own
        forwards write (``_own``) keeps reading the same objects. Parameters are put in by
        ``_install``, and everything of a module with a custom replication.
        """
        modules = self.modules(root)
        set_dict = object.__setattr__
        new_od = OrderedDict
        rebinding = self.rebinding
        # An OptimizedModule has no replica of its own (its node holds its child's).
        indices = range(len(modules)) if only is None else only
        searched = indices if search is None else search
        if searched:
            rebinding.plan(modules, [i for i in searched if self.sources[i].through is None])
        for replica in self.replicas[self.first :]:
            nodes = replica.nodes if only is None else [replica.nodes[i] for i in only]
            private: list[torch.Tensor] | None = None
            mapping = None
            for node in nodes:
                s = node.source
                if s.through is not None or s.custom:
                    continue
                tables = node.tables
                if tables is None:  # (its first fill: made once, refilled from then on)
                    params = {} if s.plain else ParameterTable(node.module)
                    tables = node.tables = ({}, params, {})
                children, params, own_buffers = tables
                children.clear()
                children.update(node.children)
                dict.clear(params)  # (past ``ParameterTable``'s writes to the attributes)
                own_buffers.clear()
                if not s.plain:  # parameters, buffers or custom hooks: not most modules
                    if private is None:
                        private = replica.buffers(buffers)
                    dict.update(params, dict.fromkeys(s.none_params))
                    own_buffers.update(buffer_table(s, private))
                d = node.module.__dict__
                d.clear()
                d.update(modules[s.index].__dict__)
                d["_modules"] = children
                d["_is_replica"] = True
                d["_former_parameters"] = new_od()
                d["_parameters"] = params
                d["_buffers"] = own_buffers
                self.own_state(d, node.hooks, modules[s.index])
                keys = rebinding.keys.get(s.index)
                if keys:  # methods and hooks bound to the tree: bound to this replica
                    if mapping is None:
                        mapping = rebinding.mapping(modules, [n.module for n in replica.nodes])
                    rebind_state(d, keys, mapping, node.module)
                set_dict(node.module, "__dict__", d)
        self.own_writes.watch(self.filled)
        # What cannot be rebound runs one replica at a time: parallel_apply reads the mark.
        reason = rebinding.reason(modules, len(self.devices))
        self.writes.holders = rebinding
        self.writes.head = None if self.own else id(self.replicas[0].nodes[0].module)
        self.writes.own = self.myself
        hooks = [
            tuple(map(id, table.values()))
            for m in modules
            for table in (m._forward_hooks, m._forward_pre_hooks)
        ]
        if hooks != self.hooks_seen:
            self.hooks_seen = hooks
        for replica in self.replicas[self.first :]:
            d = replica.nodes[0].module.__dict__
            d[HOOKS_SEEN] = self.hooks_seen
            d[WRITES] = self.writes
            if reason is None:
                d.pop(SERIAL, None)
            else:
                d[SERIAL] = reason

    def own_state(self, d: dict[str, Any], hooks: list[Any], source: nn.Module) -> None:
        """What a replica's new ``__dict__`` must not share with its source's."""
        own_hooks(d, hooks)
        d["zero_grad"] = replica_zero_grad  # never the module's gradients from a replica
        if d.get("_compiled_call_impl") is not None:
            # module.compile(): the compiled call is bound to the user's module; the replica
            # runs its own forward, eagerly.
            d["_compiled_call_impl"] = None
            self._warn_compiled(type(source).__name__)

    def _warn_compiled(self, what: str) -> None:
        if not self.compiled_seen:
            self.compiled_seen = True
            warn_user(eager_message(what, len(self.devices)))
