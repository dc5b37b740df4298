"""Rebind to a replica what is bound to a module of the tree.

A replica's ``__dict__`` is a copy of its source module's, so whatever the module holds that is
bound to itself would still be bound to the user's module on every replica, and run there from
every replica's thread: a ``forward`` replaced on the instance (``types.MethodType``,
accelerate's ``functools.partial(new_forward, module)``), hooks that are bound methods
(``self.lin.register_forward_hook(self._capture)``), state-dict hooks, methods kept in a tuple,
list or dict. BatchNorm then counts every chunk on the module, and a captured feature map is
whichever replica wrote last.

:func:`rebind` makes the replica's version of such a value: a bound method of a tree module
is bound to that module's replica; a ``functools.partial``, a closure (its cells and defaults)
and a tuple, list or dict that hold one are rebuilt around the rebound values (new cells only
where they held a tree module; the other cells stay shared). Containers are copied only when
they hold something rebound, so a list of numbers stays shared with the module, as any
mutable attribute is. The user's objects are never written.

What cannot be rebound (an object of the user's own class that holds the module, a value
nested deeper than :data:`MAX_DEPTH`) but still leads to a module of the tree, in a hook or an
instance ``forward``, is found by :func:`reaches`: the replica set then warns once and marks
its replicas (:data:`SERIAL`), and ``parallel_apply`` runs them one after another on the
calling thread, so that code never runs on the user's module from two threads at once.
"""

from __future__ import annotations

import copy
import dis
import functools
import gc
import operator
import types
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dataparallel._common.warn import warn_user
from dataparallel.replicate._check import filled

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

# How deep, and through how many objects, a value is searched for something to rebind. Past
# either, a value is left as it is (and announced by ``reaches`` if it leads back).
MAX_DEPTH = 32
MAX_VISITS = 20_000

# The key a replica's __dict__ holds when its set must run one replica at a time (the value
# says why); read by parallel_apply.
SERIAL = "_dataparallel_serial"

# The key of a replica root's __dict__ that holds the tree's forward hooks and pre-hooks (their
# identities) as of the last fill: a compiled call made for other hooks must be made again
# (dynamo does not guard on hooks). Read by ``CompiledReplicas``.
HOOKS_SEEN = "_dataparallel_hooks"

# The hook tables whose hooks are rebound (each replica gets its own copy of a table that holds
# one). Load-state-dict hooks are left: loading into a replica is not something forward does.
REBOUND_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
)

# __dict__ entries never searched as attributes: torch's own (every entry a bare module has:
# tables a fill replaces or that hold no user code, flags); the hook tables of
# :data:`REBOUND_TABLES` are searched hook by hook, apart.
_SKIPPED = frozenset(nn.Module().__dict__) - {"training"}
# Types that never hold anything to rebind (most attributes): skipped by one set lookup.
_ATOMS = frozenset(
    (bool, int, float, complex, str, bytes, type(None), torch.Tensor, nn.Parameter, torch.dtype)
)
# Never looked into: classes and modules live as long as the program; a tensor (of a
# subclass too) is data, not a holder.
_OPAQUE = (type, types.ModuleType, torch.Tensor, types.BuiltinFunctionType, types.CodeType)

Mapping = dict[int, Any]  # id of a tree module -> what to bind in its place

# What the search binds in place of a tree module: anything that is no module of the tree.
_PROBE = object()
_KINDS = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "forward": "forward",
}


class Rebinding:
    """What one replica set rebinds, per module of the source tree (by preorder index).

    ``keys``: the ``__dict__`` entries of a module that hold something bound to the tree
    (searched at each refill of the module, applied to each replica's new ``__dict__``);
    ``serial``: the modules whose hooks, forward or attributes lead back to the tree through
    something that cannot be rebound, and which one (the replicas then run one at a time);
    ``watched``: per module, each holder its replicas hold a rebuilt copy of (a list of
    submodules, a closure's cells, an object of the user's own), with what it held then: a
    write to one since (``order.append(m)``, ``route["k"] = m``) refills that module.
    """

    __slots__ = ("keys", "serial", "warned", "watched")

    def __init__(self) -> None:
        self.keys: dict[int, tuple[str, ...]] = {}
        self.serial: dict[int, tuple[str, Any]] = {}
        self.watched: dict[int, list[tuple[Any, list[Any]]]] = {}
        self.warned = False

    def plan(self, modules: list[nn.Module], indices: Any) -> None:
        """Search the modules at ``indices`` (just refilled) of the tree ``modules``."""
        probe = dict.fromkeys(map(id, modules), _PROBE)
        tree = set(probe)
        for i in indices:
            d = modules[i].__dict__
            search = _Pass(probe)
            keys = bound_keys(d, search, type(modules[i]))
            if keys:
                self.keys[i] = keys
                self.watched[i] = search.copied
            else:
                self.keys.pop(i, None)
                self.watched.pop(i, None)
            found = _unbound(d, probe, tree)
            if found is None:
                self.serial.pop(i, None)
            else:
                self.serial[i] = found

    def mapping(self, modules: list[nn.Module], objects: list[nn.Module]) -> _Pass:
        """A pass that binds each module of the tree to ``objects``, its replicas on one
        device (in the same preorder): one per replica, so what two modules share stays
        shared."""
        return _Pass(dict(zip(map(id, modules), objects, strict=True)))

    def same(self) -> bool:
        """Whether every holder the replicas copied still holds what it held (identities)."""
        for watched in self.watched.values():
            for obj, held in watched:
                now = contents(obj)
                if len(now) != len(held) or not all(map(operator.is_, now, held)):
                    return False
        return True

    def changed(self) -> list[int]:
        """The modules one of whose copied holders was written since."""
        return [
            i
            for i, watched in self.watched.items()
            if any(
                len(now := contents(obj)) != len(held) or not all(map(operator.is_, now, held))
                for obj, held in watched
            )
        ]

    def reason(self, modules: list[nn.Module], replicas: int) -> str | None:
        """Why the replicas of the tree ``modules`` must run one at a time (``None``: they
        need not); warns once per replica set."""
        if not self.serial:
            return None
        index, (table, hook) = min(self.serial.items())
        names = {id(m): n for n, m in modules[0].named_modules()}
        name = names.get(id(modules[index]), type(modules[index]).__name__)
        what = getattr(hook, "__qualname__", None) or type(hook).__name__
        where = f"module {name!r}" if name else "the module itself"
        reason = f"the {_KINDS.get(table, f'attribute {table!r},')} {what} of {where}"
        if not self.warned and replicas > 1:
            self.warned = True
            warn_user(
                f"module: {reason} leads back to the module through an object that cannot be "
                f"rebound to each replica, so it would run on your module from every replica's "
                f"thread at once; the replicas of this module run one after another on the "
                f"calling thread instead. To run them in parallel, make it a method of the "
                f"module, or a function, closure or functools.partial over the module: those "
                f"are rebound to each replica"
            )
        return reason


def _unbound(d: dict[str, Any], probe: Mapping, tree: set[int]) -> tuple[str, Any] | None:
    """The first hook, instance ``forward`` or attribute of a module's ``__dict__`` ``d`` that
    still leads to the tree once rebound (something a copy cannot make, a function that
    assigns a global), as (table or attribute name, value)."""
    forward = d.get("forward")
    if forward is not None and reaches(rebind(forward, probe), tree):
        return "forward", forward
    for name in REBOUND_TABLES:
        table = d.get(name)
        for hook in table.values() if table else ():
            if reaches(rebind(hook, probe), tree):
                return name, hook
    for name, value in d.items():
        if type(value) in _ATOMS or name in _SKIPPED or name == "forward":
            continue
        if reaches(rebind(value, probe), tree):
            return name, value
    return None


def rebind(value: Any, mapping: Mapping) -> Any:
    """``value`` with every tree module in ``mapping`` (by id) replaced by its replica, where
    it is bound or held as described in the module docstring; ``value`` itself when nothing in
    it changes."""
    return _Pass(mapping).rebind(value, 0)


class _Pass:
    """One rebinding of a value: the mapping, a memo (each object is rebuilt once, so shared
    holders stay shared and cycles end), and a budget of objects looked into.

    ``copied`` lists each source object that was rebuilt, with what it held when it was read
    (:func:`contents`): a write to it later (an item set, an append) is a change the replicas
    must see, and the check compares exactly these.
    """

    __slots__ = ("copied", "mapping", "memo", "visits")

    def __init__(self, mapping: Mapping) -> None:
        self.mapping = mapping
        self.memo: dict[int, Any] = {}
        self.copied: list[tuple[Any, list[Any]]] = []
        self.visits = 0

    def rebind(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if kind in _ATOMS:
            return value
        if kind is types.MethodType:
            target = self.mapping.get(id(value.__self__))
            owner = target if target is not None else self.rebind(value.__self__, depth + 1)
            # the function too: a lambda installed as a method may close over a bound method
            # of the module (``orig = m.forward``, the common monkey-patch)
            func = self.rebind(value.__func__, depth + 1)
            if owner is value.__self__ and func is value.__func__:
                return value
            return types.MethodType(func, owner)
        if isinstance(value, nn.Module):
            return self.mapping.get(id(value), value)
        if depth >= MAX_DEPTH or self.visits >= MAX_VISITS or isinstance(value, _OPAQUE):
            return value
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = value  # a cycle back to this value keeps it as it is
        self.visits += 1
        try:
            result = self._rebuild(value, kind, depth + 1)
        except Exception:  # an object copy cannot make: left as it is (``reaches`` decides)
            result = value
        if result is not value:
            self.copied.append((value, contents(value)))
        self.memo[key] = result
        return result

    def _rebuild(self, value: Any, kind: type, deeper: int) -> Any:
        rebind = self.rebind
        if kind is tuple or kind is list:
            if _ATOMS.issuperset(map(type, value)):  # kernel sizes, paddings: one C-level pass
                return value
            items = [rebind(v, deeper) for v in value]
            if all(map(operator.is_, items, value)):
                return value
            return kind(items)
        if kind is dict:
            new = {k: rebind(v, deeper) for k, v in value.items()}
            return value if all(new[k] is v for k, v in value.items()) else new
        if isinstance(value, functools.partial):
            return self._partial(value, deeper)
        if kind is types.FunctionType:
            return self._function(value, deeper)
        if isinstance(value, tuple):  # a namedtuple, or another tuple of the user's
            items = [rebind(v, deeper) for v in value]
            if all(map(operator.is_, items, value)):
                return value
            make = getattr(kind, "_make", None)
            return make(items) if make is not None else kind(items)
        if isinstance(value, dict):  # OrderedDict, defaultdict, a dict of the user's
            entries = {k: rebind(v, deeper) for k, v in value.items()}
            if all(entries[k] is v for k, v in value.items()):
                return value
            new = copy.copy(value)
            new.clear()
            new.update(entries)
            return new
        if isinstance(value, list):
            items = [rebind(v, deeper) for v in value]
            if all(map(operator.is_, items, value)):
                return value
            copied: list[Any] = copy.copy(value)
            copied[:] = items
            return copied
        state = getattr(value, "__dict__", None)
        if type(state) is not dict:  # no state of its own to rebind (slots, C objects)
            return value
        # An object of the user's own (a dataclass, a SimpleNamespace, any class): a shallow
        # copy, as copy.copy makes it, whose attributes are rebound.
        entries = {k: rebind(v, deeper) for k, v in state.items()}
        changed = {k: v for k, v in entries.items() if v is not state[k]}
        if not changed:
            return value
        new = copy.copy(value)
        if type(getattr(new, "__dict__", None)) is not dict or new is value:
            return value
        new.__dict__.update(changed)
        return new

    def _partial(self, value: functools.partial[Any], deeper: int) -> Any:
        rebind = self.rebind
        func = rebind(value.func, deeper)
        args = [rebind(a, deeper) for a in value.args]
        keywords = {k: rebind(v, deeper) for k, v in value.keywords.items()}
        extra = {k: rebind(v, deeper) for k, v in value.__dict__.items()}
        if (
            func is value.func
            and all(map(operator.is_, args, value.args))
            and all(keywords[k] is v for k, v in value.keywords.items())
            and all(extra[k] is v for k, v in value.__dict__.items())
        ):
            return value
        new = type(value)(func, *args, **keywords)
        new.__dict__.update(extra)  # functools.update_wrapper's __wrapped__, __name__, ...
        return new

    def _function(self, value: types.FunctionType, deeper: int) -> Any:
        rebind = self.rebind
        cells = value.__closure__ or ()
        new_cells = list(cells)
        changed = False
        for i, cell in enumerate(cells):
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell (a name not assigned yet)
                continue
            rebound = rebind(held, deeper)
            if rebound is not held:
                new_cells[i] = types.CellType(rebound)
                changed = True
        defaults = value.__defaults__
        if defaults:
            new_defaults = tuple(rebind(d, deeper) for d in defaults)
            changed = changed or not all(map(operator.is_, new_defaults, defaults))
            defaults = new_defaults
        kwdefaults = value.__kwdefaults__
        if kwdefaults:
            new_kw = {k: rebind(v, deeper) for k, v in kwdefaults.items()}
            changed = changed or any(new_kw[k] is not v for k, v in kwdefaults.items())
            kwdefaults = new_kw
        # Module-level names the code reads (``model`` in a hook of the user's script): the
        # replica's function reads the rebound ones from an overlay, every other name from the
        # script's own globals, live. A function that assigns a global keeps its globals (a
        # copy would lose the write); ``reaches`` then finds its way back to the tree.
        globals_ = value.__globals__
        overlay: dict[str, Any] = {}
        reads, writes = global_names(value.__code__)
        if not writes:
            for name in reads:
                held = globals_.get(name, _ABSENT)
                if held is _ABSENT:
                    continue
                rebound = rebind(held, deeper)
                if rebound is not held:
                    overlay[name] = rebound
        if overlay:
            globals_ = _Globals(overlay, value.__globals__)
            changed = True
        if not changed:
            return value
        fn = types.FunctionType(
            value.__code__, globals_, value.__name__, defaults, tuple(new_cells)
        )
        fn.__kwdefaults__ = kwdefaults
        fn.__qualname__ = value.__qualname__
        fn.__doc__ = value.__doc__
        fn.__module__ = value.__module__
        fn.__dict__.update(value.__dict__)
        return fn


_ABSENT = object()


class _Globals(dict[str, Any]):
    """A replica function's globals: the rebound names, and every other name read live from
    the script's own globals (``__missing__``), so a later assignment there is seen."""

    def __init__(self, overlay: dict[str, Any], base: dict[str, Any]) -> None:
        super().__init__(overlay)
        self.base = base

    def __missing__(self, key: str) -> Any:
        return self.base[key]


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> tuple[frozenset[str], bool]:
    """The module-level names a code object (and the functions, lambdas and comprehensions it
    defines) reads, and whether any of it assigns or deletes a global."""
    reads: set[str] = set()
    writes = False
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            reads.add(instruction.argval)
        elif instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            writes = True
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner, inner_writes = global_names(const)
            reads |= inner
            writes = writes or inner_writes
    return frozenset(reads), writes


def contents(value: Any) -> list[Any]:
    """What a holder holds, as identities to compare later: items, keys and values, the
    attributes of an object, the cells and defaults of a function."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (tuple, list)):
        return list(value)
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values(), *value.__dict__.values()]
    if isinstance(value, types.FunctionType):
        cells = [c.cell_contents if filled(c) else _ABSENT for c in value.__closure__ or ()]
        reads, _ = global_names(value.__code__)
        g = value.__globals__
        return [
            *cells,
            *(value.__defaults__ or ()),
            *(value.__kwdefaults__ or {}).values(),
            *(g.get(n, _ABSENT) for n in sorted(reads)),
        ]
    state = getattr(value, "__dict__", None)
    return [*state.keys(), *state.values()] if isinstance(state, dict) else []


# The key ``bound_keys`` gives for a class's own ``forward`` that reads a module-level name
# leading to the tree: each replica gets that function, rebound, as its instance ``forward``.
CLASS_FORWARD = "forward of the class"


def bound_keys(
    d: dict[str, Any], probe: Mapping | _Pass, cls: type | None = None
) -> tuple[str, ...]:
    """The entries of a module's ``__dict__`` (plain attributes, and the hook tables of
    :data:`REBOUND_TABLES`) that hold something :func:`rebind` changes, with ``probe`` any
    mapping of the tree's module ids (or a pass over one, which then records what it copied);
    :data:`CLASS_FORWARD` when the class's ``forward`` reads a module-level name that leads to
    the tree. Searched once per module per refill; most modules have none."""
    search = probe if isinstance(probe, _Pass) else _Pass(probe)
    found: list[str] = []
    if cls is not None and "forward" not in d:
        forward = getattr(cls, "forward", None)
        if type(forward) is types.FunctionType and search.rebind(forward, 0) is not forward:
            found.append(CLASS_FORWARD)
    for name, value in d.items():
        if type(value) in _ATOMS or name in _SKIPPED:
            continue
        if search.rebind(value, 0) is not value:
            found.append(name)
    for name in REBOUND_TABLES:
        table = d.get(name)
        if table and any(search.rebind(h, 0) is not h for h in table.values()):
            found.append(name)
    return tuple(found)


def rebind_state(
    d: dict[str, Any], keys: tuple[str, ...], search: _Pass, replica: nn.Module
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


def reaches(value: Any, tree: set[int], limit: int = 5_000) -> bool:
    """Whether ``value`` (a rebound hook or forward) still leads to a module whose id is in
    ``tree``: through an object's attributes, a closure, a bound method, at any depth. Other
    modules (the replicas) are not looked into. A search past ``limit`` objects answers
    ``False``: the hook is then assumed not to touch the tree (a logger, a large registry)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, nn.Module):
            if id(obj) in tree:
                return True
            continue
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            return False
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if filled(c))
            # the module-level names its code reads (``model`` in a hook of the script)
            reads, _ = global_names(obj.__code__)
            g = obj.__globals__
            stack.extend(g[name] for name in reads if name in g)
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            stack.append(obj.__dict__)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
            stack.append(obj.__func__)
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
