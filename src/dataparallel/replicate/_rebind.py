"""Rebind to a replica what is bound to a module of the tree.

A replica's ``__dict__`` is a copy of its source module's, so whatever the module holds that is
bound to itself would still be bound to the user's module on every replica, and run there from
every replica's thread: a ``forward`` replaced on the instance (``types.MethodType``,
accelerate's ``functools.partial(new_forward, module)``), hooks that are bound methods
(``self.lin.register_forward_hook(self._capture)``), state-dict hooks, methods kept in a tuple,
list or dict. BatchNorm then counts every chunk on the module, and a captured feature map is
whichever replica wrote last.

``_copy.rebind`` makes the replica's version of such a value: every holder on the way to a
module of the tree (containers, objects of the user's own, closures, partials, bound methods,
the module-level names a function reads) is rebuilt around the replica's modules, at any
depth; what leads nowhere stays shared. Here is what is rebound per module (:class:`Rebinding`:
the entries of each ``__dict__``, the class's ``forward`` when it reads a module-level name
that leads to the tree, the holders copied, to see a later write to them), and how a replica's
new ``__dict__`` gets it (:func:`rebind_state`). The user's objects are never written.

What cannot be rebound (an object without a ``__dict__``, a copy that fails, a function that
assigns a global, a value past :data:`MAX_DEPTH`) but still leads to a module of the tree, in a
hook, an instance ``forward`` or an attribute, is found by :func:`reaches`: the replica set
then warns once and marks its replicas (:data:`SERIAL`), and ``parallel_apply`` runs them one
after another on the calling thread, so that code never runs on the user's module from two
threads at once.
"""

from __future__ import annotations

import gc
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dataparallel._common.warn import warn_user
from dataparallel.replicate._copy import Mapping, Pass, rebind
from dataparallel.replicate._holders import Held
from dataparallel.replicate._kinds import (
    ATOMS,
    MAX_DEPTH,
    contents,
    from_library,
    global_names,
    plain_record,
)
from dataparallel.replicate._library import library_module
from dataparallel.replicate._naming import (
    KINDS,
    REBOUND_TABLES,
    hook_name,
    serial_message,
    written_message,
)
from dataparallel.replicate._reach import filled

__all__ = [
    "HOOKS_SEEN",
    "MAX_DEPTH",
    "REBOUND_TABLES",
    "SERIAL",
    "Rebinding",
    "bound_keys",
    "reaches",
    "rebind",
    "rebind_state",
    "replica_zero_grad",
    "serial_mark",
]

# The key a replica's __dict__ holds when its set must run one replica at a time (the value
# says why); read by parallel_apply.
SERIAL = "_dataparallel_serial"

# The key of a replica root's __dict__ that holds the tree's forward hooks and pre-hooks (their
# identities) as of the last fill: a compiled call made for other hooks must be made again
# (dynamo does not guard on hooks). Read by ``CompiledReplicas``.
HOOKS_SEEN = "_dataparallel_hooks"

# __dict__ entries never searched as attributes: torch's own (every entry a bare module has:
# tables a fill replaces or that hold no user code, flags); the hook tables of
# :data:`REBOUND_TABLES` are searched hook by hook, apart.
_SKIPPED = frozenset(nn.Module().__dict__) - {"training"}
# A class may name the attributes its own ``_replicate_for_data_parallel`` leaves out of a
# replica (a nested ``DataParallel``'s lock, replicas and plans): no replica holds them, so they
# are never searched either (they lead back to the tree through the wrapper's own replicas).
NOT_REPLICATED = "_not_replicated"


def _skipped(cls: type | None) -> frozenset[str]:
    """The ``__dict__`` entries of a module of class ``cls`` that are never searched."""
    own = getattr(cls, NOT_REPLICATED, None)
    return _SKIPPED | own if own else _SKIPPED


# What the search binds in place of a tree module: anything that is no module of the tree.
_PROBE = object()


class Rebinding:
    """What one replica set rebinds, per module of the source tree (by preorder index).

    ``keys``: the ``__dict__`` entries of a module that hold something bound to the tree
    (searched at each refill of the module, applied to each replica's new ``__dict__``);
    ``serial``: the modules whose hooks, forward or attributes lead back to the tree through
    something that cannot be rebound, or are too large to search, and which one and why
    (``"unbound"``, ``"limit"``, or ``"thread"`` for a ``threading.local``; the replicas then
    run one at a time);
    ``watched``: per module, each holder its replicas hold a rebuilt copy of (a list of
    submodules, a closure's cells, an object of the user's own), with what it held then: a
    write to one since (``order.append(m)``, ``route["k"] = m``) refills that module;
    ``tensors``: the modules some of whose entries hold a parameter or buffer of the tree (a
    list of a teacher's parameters made in ``__init__``), which each replica's install binds
    to that replica's own tensors (:meth:`bind_tensors`), as they may change at every call.
    """

    __slots__ = ("classes", "keys", "probe", "serial", "tensors", "told", "warned", "watched")

    def __init__(self) -> None:
        self.told: set[int] = set()  # the holders said written in forward (their ids)
        self.classes: dict[type, int] = {}  # each class's module watching it (``class_dicts``)
        self.keys: dict[int, tuple[str, ...]] = {}
        self.serial: dict[int, tuple[str, Any, str]] = {}
        self.watched: dict[int, list[Held]] = {}
        self.warned = False
        self.probe: Mapping = {}  # the tree's module ids, as of the last search
        self.tensors: set[int] = set()

    def plan(self, modules: list[nn.Module], indices: Any) -> None:
        """Search the modules at ``indices`` (just refilled) of the tree ``modules``."""
        probe = self.probe = dict.fromkeys(map(id, modules), _PROBE)
        tree = set(probe)
        # The tree's parameters and buffers: the replica set's to sync, never watched here
        # (what forward writes of them is ``_written``'s and ``copy_writes_back``'s), nor a
        # view of one: it shares its base's version, which replica 0's own write of a frozen
        # parameter moves once.
        own = {
            id(t)
            for m in modules
            for table in (m._parameters, m._buffers)
            for t in table.values()
            if t is not None
        }
        bindable = dict.fromkeys(own, _PROBE)  # (bound as modules are: ``bind_tensors``)
        # The numpy arrays read on every call are within one budget for the whole tree.
        again = set(indices)
        used = sum([_array_bytes(w) for i, w in self.watched.items() if i not in again])
        for i in indices:
            d = modules[i].__dict__
            search = Pass(probe, watch=True, own=bindable)
            search.room = max(0, search.room - used)
            keys, cut = bound_keys(d, search, type(modules[i]))
            if keys:
                self.keys[i] = keys
            else:
                self.keys.pop(i, None)
            if search.bound:
                self.tensors.add(i)
            else:
                self.tensors.discard(i)
            # Every holder the search read, copied or left shared: a write to one since is a
            # change (a list that led nowhere, later given a module of the tree).
            tensors = {
                id(t): t
                for t in search.tensors
                if id(t) not in own and (t._base is None or id(t._base) not in own)
            }
            watched = [
                *(Held(obj, held) for obj, held in search.copied),
                *(Held(obj, held, shared=True) for obj, held in search.walked),
                *(Held(t, [], shared=True) for t in tensors.values()),
                *(Held(r, [], shared=True) for r in search.readable),
                *(Held(d, contents(d), shared=True) for d in self.class_dicts(modules[i], i)),
            ]
            used += _array_bytes(watched)
            if watched:
                self.watched[i] = watched
            else:
                self.watched.pop(i, None)
            found = cut or _unbound(d, probe, tree, _skipped(type(modules[i])))
            if found is None:
                self.serial.pop(i, None)
            else:
                self.serial[i] = found

    def mapping(self, modules: list[nn.Module], objects: list[nn.Module]) -> Pass:
        """A pass that binds each module of the tree to ``objects``, its replicas on one
        device (in the same preorder): one per replica, so what two modules share stays
        shared."""
        return Pass(dict(zip(map(id, modules), objects, strict=True)))

    def bind_tensors(
        self,
        sources: list[nn.Module],
        modules: list[nn.Module],
        indices: list[int],
        own: Mapping,
    ) -> None:
        """Rebind, in one replica (its modules ``modules``, in the preorder of the tree
        ``sources``), the entries of the modules at ``indices`` that hold parameters or buffers
        of the tree to the replica's own tensors for them (``own``: by the tree's tensor ids),
        from each source module's own entries, so this call's tensors replace the last call's."""
        search = Pass(dict(zip(map(id, sources), modules, strict=True)), own=own)
        for i in sorted(indices):
            keys = self.keys.get(i, ())
            source = sources[i].__dict__
            values = {name: source[name] for name in keys if name in source}
            rebind_state(values, keys, search, modules[i])
            modules[i].__dict__.update(values)

    def class_dicts(self, module: nn.Module, index: int) -> list[dict[str, Any]]:
        """The dictionaries of ``module``'s classes that are the user's (not a library's, not
        ``nn.Module``'s) and that no earlier module of the tree (preorder ``index``) has: one
        object every replica shares, whose write in forward (``type(self).calls += 1``) is
        made once per replica. Watched as shared holders, by their write version."""
        found = []
        for cls in type(module).__mro__:
            if (
                self.classes.setdefault(cls, index) == index
                and cls is not nn.Module
                and cls is not object
                and not library_module(cls.__module__)
            ):
                found += gc.get_referents(cls.__dict__)[:1]  # (the dict under the view)
        return found

    def same(self) -> bool:
        """Whether every holder the replicas copied still holds what it held (identities; a
        list that only grew by what leads to no module of the tree counts as the same)."""
        probe = self.probe
        for watched in self.watched.values():
            for holder in watched:
                if not holder.still(probe):
                    return False
        return True

    def changed(self) -> list[int]:
        """The modules one of whose copied holders was written since."""
        probe = self.probe
        return [
            i
            for i, watched in self.watched.items()
            if not all([holder.still(probe) for holder in watched])
        ]

    def said_written(self, root: nn.Module, replicas: int) -> None:
        """After the replicas of one call ran: say, once per holder, each holder the replicas
        share (one that leads to no module of the tree: a hook's history list, a stats dict, a
        ``Counter``) that their forwards wrote. Each replica writes that very object, so a
        write one device makes once per forward is made by every replica that reaches it, and
        none of them can be taken back; nothing is refused (a logging hook is most often such
        a write), the difference is said where it happens."""
        said = self.told
        for i, watched in self.watched.items():
            for holder in watched:
                if holder.shared and id(holder.obj) not in said and holder.written():
                    said.add(id(holder.obj))
                    warn_user(written_message(root, i, holder.obj, replicas, holder.held))

    def reason(self, modules: list[nn.Module], replicas: int) -> str | None:
        """Why the replicas of the tree ``modules`` must run one at a time (``None``: they
        need not); warns once per replica set."""
        if not self.serial:
            return None
        index, (table, hook, why) = min(self.serial.items())
        names = {id(m): n for n, m in modules[0].named_modules()}
        name = names.get(id(modules[index]), type(modules[index]).__name__)
        where = f"module {name!r}" if name else "the module itself"
        reason = f"the {KINDS.get(table, f'attribute {table!r},')} {hook_name(hook)} of {where}"
        if not self.warned and replicas > 1:
            self.warned = True
            warn_user(serial_message(reason, why))
        return reason


def _array_bytes(watched: list[Held]) -> int:
    """The bytes of the numpy arrays among ``watched``, read on every call."""
    return sum([h.obj.nbytes for h in watched if isinstance(h.obj, np.ndarray)])


def _unbound(
    d: dict[str, Any], probe: Mapping, tree: set[int], skipped: frozenset[str] = _SKIPPED
) -> tuple[str, Any, str] | None:
    """The first hook, instance ``forward`` or attribute of a module's ``__dict__`` ``d`` that
    still leads to the tree once rebound (something a copy cannot make, a function that
    assigns a global), or whose way back is too large to search, as (table or attribute name,
    value, ``"unbound"`` or ``"limit"``). ``skipped``: entries never searched (``_skipped``)."""

    def leads(value: Any) -> str | None:
        found = reaches(rebind(value, probe), tree)
        return None if found is False else "unbound" if found else "limit"

    forward = d.get("forward")
    if forward is not None and (why := leads(forward)):
        return "forward", forward, why
    for name in REBOUND_TABLES:
        table = d.get(name)
        for hook in table.values() if table else ():
            if why := leads(hook):
                return name, hook, why
    for name, value in d.items():
        if type(value) in ATOMS or name in skipped or name == "forward":
            continue
        if why := leads(value):
            return name, value, why
    return None


# The key ``bound_keys`` gives for a class's own ``forward`` that reads a module-level name
# leading to the tree: each replica gets that function, rebound, as its instance ``forward``.
CLASS_FORWARD = "forward of the class"


def bound_keys(
    d: dict[str, Any], probe: Mapping | Pass, cls: type | None = None
) -> tuple[tuple[str, ...], tuple[str, Any, str] | None]:
    """The entries of a module's ``__dict__`` (plain attributes, and the hook tables of
    :data:`REBOUND_TABLES`) that hold something :func:`rebind` changes, with ``probe`` any
    mapping of the tree's module ids (or a pass over one, which then records what it copied);
    :data:`CLASS_FORWARD` when the class's ``forward`` reads a module-level name that leads to
    the tree. Searched once per module per refill; most modules have none.

    Also the first entry the search stopped short in (past its depth or object limits), as
    ``(table or attribute name, value, "limit")``, else ``None``: what lies beyond was not
    searched, so it may lead to the tree unrebound; or the first that holds a
    ``threading.local``, with ``"thread"``: a replica on a worker thread would not see what the
    caller's thread set in it.
    """
    search = probe if isinstance(probe, Pass) else Pass(probe)
    found: list[str] = []
    cut: tuple[str, Any, str] | None = None
    skipped = _skipped(cls)

    def look(name: str, value: Any) -> bool:
        nonlocal cut
        was, local = search.cut, search.local
        changed = search.rebind(value, 0) is not value
        if search.cut and not was and cut is None:
            cut = (name, value, "limit")
        if search.local is not local and cut is None:
            cut = (name, value, "thread")
        return changed

    if cls is not None and "forward" not in d:
        forward = getattr(cls, "forward", None)
        if type(forward) is types.FunctionType and look("forward", forward):
            found.append(CLASS_FORWARD)
    for name, value in d.items():
        if type(value) in ATOMS or name in skipped:
            if type(value) is torch.Tensor and search.watch and name not in skipped:
                search.tensors.insert(0, value)  # (a plain tensor attribute: its version read)
            continue
        if look(name, value):
            found.append(name)
    for name in REBOUND_TABLES:
        table = d.get(name)
        if table and any([look(name, h) for h in table.values()]):
            found.append(name)
    return tuple(found), cut


def rebind_state(
    d: dict[str, Any], keys: tuple[str, ...], search: Pass, replica: nn.Module
) -> None:
    """Rebind the entries ``keys`` of a replica's new ``__dict__`` ``d`` in ``search`` (a pass
    over one replica's mapping: a holder shared by two modules stays one holder on the
    replica); a hook table gets a new table of its own (the source's is never written)."""
    for name in keys:
        if name == CLASS_FORWARD:
            forward = getattr(type(replica), "forward", None)
            if type(forward) is types.FunctionType:
                d["forward"] = types.MethodType(search.rebind(forward, 0), replica)
            continue
        value = d[name]
        if name in REBOUND_TABLES:
            d[name] = OrderedDict((k, search.rebind(h, 0)) for k, h in value.items())
        else:
            d[name] = search.rebind(value, 0)


# Not followed when looking for a way back to the tree: leaves, and what lives as long as the
# program anyway (classes, modules).
_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.Tensor, type, types.ModuleType)


def reaches(value: Any, tree: set[int], limit: int = 5_000) -> bool | None:
    """Whether ``value`` (a rebound hook or forward) still leads to a module whose id is in
    ``tree``: through an object's attributes, a closure, a bound method, at any depth. Other
    modules (the replicas) are not looked into. A search past ``limit`` objects answers
    ``None``: it is not known (a logger, a large registry), and the caller runs the replicas
    one at a time rather than assume."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, nn.Module):
            if id(obj) in tree:
                return True
            continue
        if id(obj) in seen or isinstance(obj, _LEAVES) or plain_record(obj, type(obj)):
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            return None
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if filled(c))
            # the module-level names its code reads (``model`` in a hook of the script); a
            # library's are its own state, as ``rebind`` takes them
            if not from_library(obj, types.FunctionType):
                reads, _ = global_names(obj.__code__)
                g = obj.__globals__
                stack.extend(g[name] for name in reads if name in g)
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            stack.append(obj.__dict__)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
            stack.append(obj.__func__)
        elif isinstance(obj, types.GeneratorType):
            # As a function: its variables, what it delegates to, and the module-level names
            # its code reads, not all of its globals (3.10 shows its frame, and so them, to gc)
            frame = obj.gi_frame
            if frame is not None:
                stack.extend(frame.f_locals.values())
                reads, _ = global_names(obj.gi_code)
                stack.extend(frame.f_globals[n] for n in reads if n in frame.f_globals)
            stack.append(obj.gi_yieldfrom)
        elif isinstance(obj, weakref.ReferenceType):  # (a ``WeakValueDictionary``'s too)
            stack.append(obj())
        else:
            stack.extend(gc.get_referents(obj))
    return False


def serial_mark(replicas: Sequence[Any]) -> str | None:
    """Why ``replicate`` marked these replicas to run one after another (its ``SERIAL`` mark
    on replica 1's ``__dict__``), or ``None``. Read from what ``replicate`` returned, before
    anything wraps the replicas."""
    if len(replicas) < 2:
        return None
    mark: str | None = getattr(replicas[1], "__dict__", {}).get(SERIAL)
    return mark


def replica_zero_grad(set_to_none: bool = True) -> None:
    """A replica's ``zero_grad``: warns as torch's replicas do, and clears nothing.

    A replica lists its parameters (``self.parameters()``), which on the module's own device
    are the module's own: ``nn.Module.zero_grad`` would then clear the module's gradients from
    every replica's thread at once (a crash in torch's gradient setter), where one device
    clears them once. Replica 0, the module itself, still clears them, as on one device. Kept
    in each replica's ``__dict__`` as a plain function (no reference back to the replica).
    """
    warnings.warn(
        "Calling .zero_grad() from a module created with nn.DataParallel() has no effect on "
        "replicas: they share or copy the module's parameters; the module itself (replica 0) "
        "clears its gradients. Zero the gradients outside forward.",
        stacklevel=2,
    )
