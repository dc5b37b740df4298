"""What a value is to the replica search: how far a search goes, which values are atoms,
opaque, general holders, plain records of data or a library's own, and what a holder holds
(:func:`contents`, the identities a later call compares to see a write). The facts about
values that the copy (:mod:`._copy`), the holders it records (:mod:`._holders`) and the search
of each module (:mod:`._rebind`) share; nothing here copies or rebinds.
"""

from __future__ import annotations

import argparse
import collections
import dis
import functools
import itertools
import operator
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dataparallel.replicate._library import library_file, library_module
from dataparallel.replicate._reach import filled

__all__ = [
    "ABSENT",
    "ARRAY_BYTES",
    "ATOMS",
    "MAX_DEPTH",
    "MAX_VISITS",
    "OPAQUE",
    "RECORDS",
    "TENSORS",
    "contents",
    "from_library",
    "function_own",
    "global_names",
    "place_reader",
    "plain_record",
    "slot_names",
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
OPAQUE = (type, types.ModuleType, torch.Tensor, types.BuiltinFunctionType, types.CodeType)

# What a name, cell or slot holds where it holds nothing: a value no user code has.
ABSENT = object()


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
HOLDERS = (
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
    if isinstance(value, HOLDERS):
        return False
    return library_module(getattr(kind, "__module__", None))


RECORD = 16  # a plain record: a dict, list or tuple of at most this many atoms
RECORDS = 64  # a list or dict longer than this is a table: its plain records are data
# The most tensors one search records to be read by their version on every call (a table of
# examples the module carries is data: its tensors past these are not read).
TENSORS = 64
# The most bytes of numpy arrays one search records to be read by their bytes before and after
# every call (a numpy array has no write version): a histogram or a count table is read, a
# table of embeddings past these is data, not read (``check=`` compares it).
ARRAY_BYTES = 1 << 16


class _Place:
    """Where a suspended generator stands: its frame's last instruction with where what it
    delegates to stands (equal by ``==``), and its variables (equal by identity: a tensor's
    ``==`` is no answer; kept, so that no identity is reused while they are held)."""

    __slots__ = ("at", "values")

    def __init__(self, at: tuple[int, Any], values: list[Any]) -> None:
        self.at = at
        self.values = values

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Place)
            and self.at == other.at
            and len(self.values) == len(other.values)
            and all(map(operator.is_, self.values, other.values))
        )

    __hash__ = None  # type: ignore[assignment]


def _generator_place(gen: types.GeneratorType[Any, Any, Any]) -> _Place | None:
    """Its frame's place and variables, and where what it delegates to stands (``yield
    from``: an iterator, read the same way; one that shows no place, by its identity)."""
    frame = gen.gi_frame
    if frame is None:
        return None
    values = [*frame.f_locals.values()]
    inner = gen.gi_yieldfrom
    read = None if inner is None else place_reader(type(inner))
    if read is None:
        return _Place((frame.f_lasti, None), [*values, inner])
    return _Place((frame.f_lasti, read(inner)), values)


def _length_left(iterator: Any) -> int:
    return operator.length_hint(iterator, -1)


def place_reader(kind: type) -> Callable[[Any], Any] | None:
    """How to read where an iterator of the language stands, so that a forward that advanced
    it (``next(self.steps)``) is seen: a generator by its frame (its place and variables),
    ``itertools.count`` by its ``repr`` (its next value), another by the length it has left
    (``__length_hint__``: a list's, a range's, a dict's or a numpy array's iterator). ``None``
    for other kinds, and for an iterator that shows no place (``itertools.cycle``, ``map``,
    ``zip``; an object of the user's own is read by its attributes, as any object is)."""
    if kind is types.GeneratorType:
        return _generator_place
    if getattr(kind, "__module__", None) not in ("builtins", "itertools"):
        return None
    if kind is itertools.count:
        return repr
    if hasattr(kind, "__next__") and hasattr(kind, "__length_hint__"):
        return _length_left
    return None


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
        *[c.cell_contents if filled(c) else ABSENT for c in value.__closure__ or ()],
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
        return [*function_own(value), *(g.get(n, ABSENT) for n in sorted(reads))]
    kind = type(value)
    slots = [getattr(value, name, ABSENT) for name in slot_names(kind)]
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        return [kind, *slots, *state.keys(), *state.values()]
    return [kind, *slots]
