"""Copy a value for one replica: every holder on the way to a module of the tree rebuilt.

A replica's attributes, hooks and instance ``forward`` are the source module's; whatever in
them leads to a module of the tree would still lead to the user's module from every replica's
thread. :func:`rebind` (a :class:`Pass` for several values that share holders) copies such a
value the way ``copy.copy`` would, with a memo that maps each module of the tree to the
replica's: tuples, lists, dicts and their subclasses, objects with a ``__dict__``, closures,
partials, bound methods, and the module-level names a function reads (through an overlay of
its globals, :class:`_Globals`). What leads nowhere is shared, never copied; the user's objects
are never written. Each rebuilt holder is recorded with its :func:`contents`, so a later write
to it (an append, an item set) can be seen. Used by :mod:`._rebind`.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dis
import functools
import operator
import threading
import types
import weakref
from typing import Any

import torch
from torch import nn

from dataparallel.replicate._check import filled
from dataparallel.replicate._library import library_file, library_module

__all__ = [
    "ATOMS",
    "MAX_DEPTH",
    "MAX_VISITS",
    "RECORDS",
    "Mapping",
    "Pass",
    "contents",
    "global_names",
    "plain_record",
    "rebind",
]

# How deep, and through how many objects, a value is searched for something to rebind. Past
# either, a value is left as it is (and announced by ``reaches`` if it leads back).
MAX_DEPTH = 32
MAX_VISITS = 20_000

# Types that never hold anything to rebind (most attributes): skipped by one set lookup.
ATOMS = frozenset(
    (bool, int, float, complex, str, bytes, type(None), torch.Tensor, nn.Parameter, torch.dtype)
)
# Never looked into: classes and modules live as long as the program; a tensor (of a
# subclass too) is data, not a holder.
_OPAQUE = (type, types.ModuleType, torch.Tensor, types.BuiltinFunctionType, types.CodeType)

Mapping = dict[int, Any]  # id of a tree module -> what to bind in its place


def rebind(value: Any, mapping: Mapping) -> Any:
    """``value`` with every tree module in ``mapping`` (by id) replaced by its replica, where
    it is bound or held as described in the module docstring; ``value`` itself when nothing in
    it changes."""
    return Pass(mapping).rebind(value, 0)


class Pass:
    """One rebinding of a value: the mapping, a memo (each object is rebuilt once, so shared
    holders stay shared and cycles end), and a budget of objects looked into.

    ``copied`` lists each source object that was rebuilt, with what it held when it was read
    (:func:`contents`): a write to it later (an item set, an append) is a change the replicas
    must see, and the check compares exactly these. With ``watch``, ``walked`` lists the same
    for every holder the pass looked into and left shared (it led nowhere): a write to one
    later may make it lead to the tree (``holder.append(model)``). ``cut`` is set when the
    pass stopped short (past :data:`MAX_DEPTH` or :data:`MAX_VISITS`): what lies beyond was
    not searched. With ``watch``, ``tensors`` lists the tensors met outside a library's state
    (their data is never walked: ``_holders.Held`` reads their version). ``local`` is the
    first ``threading.local`` met outside a library's state:
    each thread sees its own attributes there, so a replica on a worker thread would not see
    what the caller's thread set (its replicas then run on the calling thread).

    ``own`` maps each parameter and buffer of the tree (by id) to what to bind in its place,
    as ``mapping`` does modules: a holder built from them (``self.ema =
    list(teacher.parameters())``) would give every replica the module's own tensors, which
    each then writes (an EMA made once per replica per call) or reads on the wrong device.
    ``bound`` is set once one was met.

    Code and objects of installed packages and the standard library (:func:`from_library`)
    are searched for the tree as any other, but are not watched, and a search that stops
    short inside them is not a cut: their state is the library's (loggers, configs,
    registries), not the model's, and watching it would cost every call.
    """

    __slots__ = (
        "bound",
        "copied",
        "cut",
        "library",
        "local",
        "mapping",
        "memo",
        "own",
        "tensors",
        "visits",
        "walked",
        "watch",
    )

    def __init__(self, mapping: Mapping, watch: bool = False, own: Mapping | None = None) -> None:
        self.mapping = mapping
        self.own: Mapping = own or {}
        self.bound = False
        self.memo: dict[int, Any] = {}
        self.copied: list[tuple[Any, list[Any]]] = []
        self.walked: list[tuple[Any, list[Any]]] = []
        self.watch = watch
        self.cut = False
        self.local: threading.local | None = None
        self.tensors: list[torch.Tensor] = []  # with ``watch``: the tensors met, not walked
        self.library = 0  # how deep inside a library's object or function the pass is
        self.visits = 0

    def rebind(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if kind in ATOMS:
            if (kind is torch.Tensor or kind is nn.Parameter) and self.own:
                mapped = self._own(value)
                if mapped is not value:
                    return mapped
            if (
                kind is torch.Tensor
                and self.watch
                and not self.library
                and len(self.tensors) < TENSORS
            ):
                self.tensors.append(value)  # (read by its version: ``_holders.Held``)
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
        if isinstance(value, _OPAQUE):
            return self._own(value) if isinstance(value, torch.Tensor) else value
        if isinstance(value, threading.local):  # (its attributes are per thread: not walked)
            if self.local is None and not self.library:
                self.local = value
            return value
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        if depth >= MAX_DEPTH or self.visits >= MAX_VISITS:
            self.cut = self.cut or not self.library
            return value
        self.memo[key] = value  # a cycle back to this value keeps it as it is
        self.visits += 1
        library = from_library(value, kind)
        self.library += library
        try:
            result = self._rebuild(value, kind, depth + 1)
        except Exception:  # an object copy cannot make: left as it is (``reaches`` decides)
            result = value
        finally:
            self.library -= library
        if result is not value:
            self.copied.append((value, contents(value)))
        elif self.watch and not self.library and not library and kind is not tuple:
            self.walked.append((value, contents(value)))  # (a tuple's items cannot change)
        self.memo[key] = result
        return result

    def _rebuild(self, value: Any, kind: type, deeper: int) -> Any:
        rebind = self.rebind
        if kind is tuple or kind is list:
            if ATOMS.issuperset(map(type, value)):  # kernel sizes, paddings: one C-level pass
                own = self.own
                if own and not self.library and any([id(v) in own for v in value]):
                    return kind(map(self._own, value))
                if self.watch and not self.library and len(value) <= RECORDS:
                    self.tensors += [v for v in value if type(v) is torch.Tensor]
                    del self.tensors[TENSORS:]
                return value
            if len(value) > RECORDS:  # a table of data: its plain records are not visited
                items = [v if plain_record(v, type(v)) else rebind(v, deeper) for v in value]
            else:
                items = [rebind(v, deeper) for v in value]
            if all(map(operator.is_, items, value)):
                return value
            return kind(items)
        if isinstance(value, dict) and not ATOMS.issuperset(map(type, value)):
            return self._keyed(value, kind, deeper)  # keys that may be modules of the tree
        if kind is dict:
            if len(value) > RECORDS:
                new = {
                    k: v if plain_record(v, type(v)) else rebind(v, deeper)
                    for k, v in value.items()
                }
            else:
                new = {k: rebind(v, deeper) for k, v in value.items()}
            return value if all(new[k] is v for k, v in value.items()) else new
        if kind is set or kind is frozenset or kind is collections.deque:
            items = [rebind(v, deeper) for v in value]
            if all(map(operator.is_, items, value)):
                return value
            if kind is collections.deque:
                return collections.deque(items, value.maxlen)
            return kind(items)
        if kind is weakref.ReferenceType:  # ``weakref.ref(parent)``: to the replica's module
            target = value()
            mapped = self.mapping.get(id(target)) if isinstance(target, nn.Module) else None
            if mapped is None or value.__callback__ is not None:
                return value  # (one with a callback: ``reaches`` follows it, serial)
            # (a search's mapping binds a probe, which only has to differ from ``value``)
            return weakref.ref(mapped) if isinstance(mapped, nn.Module) else mapped
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
        fresh = getattr(new, "__dict__", None)
        if type(fresh) is not dict or new is value:
            return value
        # A __getstate__ that leaves out what cannot be pickled (a lock, a file) makes a copy
        # without it, and with no __setstate__ nothing puts it back: the replica's copy keeps
        # every attribute the original has (shared, as a shallow copy shares them).
        for key, held in state.items():
            fresh.setdefault(key, held)
        fresh.update(changed)
        return new

    def _own(self, value: Any) -> Any:
        """What ``own`` binds in place of ``value`` (itself where nothing, or inside a
        library's object: an optimizer's parameter groups are its own state, and rebuilding it
        for each replica at every call would cost what the model does)."""
        if self.library:
            return value
        mapped = self.own.get(id(value))
        if mapped is None:
            return value
        self.bound = True
        return mapped

    def _keyed(self, value: dict[Any, Any], kind: type, deeper: int) -> Any:
        """A dict some of whose keys are not atoms (``{module: name}``, as a hook that names
        the module it runs on keeps): keys and values rebound."""
        rebind = self.rebind
        entries = [(rebind(k, deeper), rebind(v, deeper)) for k, v in value.items()]
        pairs = zip(entries, value.items(), strict=True)
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in pairs):
            return value
        if kind is dict:
            return dict(entries)
        new = copy.copy(value)
        new.clear()
        new.update(entries)
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
        if not writes and not from_library(value, types.FunctionType):
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


# General holders (and their subclasses: OrderedDict, defaultdict, namedtuples), which hold
# the user's state whoever defined their class.
_HOLDERS = (
    list,
    dict,
    tuple,
    set,
    frozenset,
    functools.partial,
    types.SimpleNamespace,
    collections.deque,
    collections.UserList,
    collections.UserDict,
    collections.ChainMap,
    argparse.Namespace,
)


def from_library(value: Any, kind: type) -> bool:
    """Whether ``value`` (a function, or an object of class ``kind``) is an installed
    package's or the standard library's: its code, or its class, is defined there. General
    holders (lists, dicts, tuples, sets, partials, namespaces, deques, and their subclasses)
    are never: what they hold is whoever filled them's."""
    if kind is types.FunctionType:
        # by where its code lies: ``functools.wraps`` copies a library function's
        # ``__module__`` onto a wrapper of the user's own
        return library_file(value.__code__.co_filename)
    if isinstance(value, _HOLDERS):
        return False
    return library_module(getattr(kind, "__module__", None))


RECORD = 16  # a plain record: a dict, list or tuple of at most this many atoms
RECORDS = 64  # a list or dict longer than this is a table: its plain records are data
# The most tensors one search records to be read by their version on every call (a table of
# examples the module carries is data: its tensors past these are not read).
TENSORS = 64


def plain_record(value: Any, kind: type) -> bool:
    """Whether ``value`` is a small dict, list or tuple of atoms only (keys too): a record of
    data (``{"step": 3, "loss": 0.5}``), which leads to no module. Inside another holder such
    records are neither searched one by one nor watched when the holder is a table (over
    :data:`RECORDS` items): a list of 30,000 of them is one holder, compared as one."""
    if kind is dict:
        return len(value) <= RECORD and ATOMS.issuperset(
            [*map(type, value), *map(type, value.values())]
        )
    if kind is list or kind is tuple:
        return len(value) <= RECORD and ATOMS.issuperset(map(type, value))
    return False


_SLOTS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def slot_names(cls: type) -> tuple[str, ...]:
    """The slots ``cls`` and its bases declare (private names mangled), past ``__dict__`` and
    ``__weakref__``; found once per class."""
    found = _SLOTS.get(cls)
    if found is not None:
        return found
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            names.append(name)
    _SLOTS[cls] = found = tuple(names)
    return found


def function_own(value: types.FunctionType) -> list[Any]:
    """The part of a function's ``contents`` that is its own, not its module's globals: its
    code, the values of its cells, its defaults."""
    return [
        value.__code__,
        *[c.cell_contents if filled(c) else _ABSENT for c in value.__closure__ or ()],
        *(value.__defaults__ or ()),
        *(value.__kwdefaults__ or {}).values(),
    ]


def contents(value: Any) -> list[Any]:
    """What a holder holds, as identities to compare later: items, keys and values, the
    attributes of an object (its class and slots too), the code, cells and defaults of a
    function. A class swapped (``obj.__class__ = Other``), a slot written or a code object
    swapped (``f.__code__ = g.__code__``) is then a change, as a written attribute is."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (tuple, list, set, frozenset, collections.deque)):
        return list(value)
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values(), *value.__dict__.values()]
    if isinstance(value, types.FunctionType):
        reads, _ = global_names(value.__code__)
        g = value.__globals__
        return [*function_own(value), *(g.get(n, _ABSENT) for n in sorted(reads))]
    kind = type(value)
    slots = [getattr(value, name, _ABSENT) for name in slot_names(kind)]
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        return [kind, *slots, *state.keys(), *state.values()]
    return [kind, *slots]
