"""Copy a value for one replica: every holder on the way to a module of the tree rebuilt.

A replica's attributes, hooks and instance ``forward`` are the source module's; whatever in
them leads to a module of the tree would still lead to the user's module from every replica's
thread. :func:`rebind` (a :class:`Pass` for several values that share holders) copies such a
value the way ``copy.copy`` would, with a memo that maps each module of the tree to the
replica's: tuples, lists, dicts and their subclasses, objects with a ``__dict__``, closures,
partials, bound methods, and the module-level names a function reads (through an overlay of
its globals, :class:`_Globals`). What leads nowhere is shared, never copied; the user's objects
are never written. Each rebuilt holder is recorded with its ``_kinds.contents``, so a later write
to it (an append, an item set) can be seen. Used by :mod:`._rebind`.
"""

from __future__ import annotations

import collections
import copy
import functools
import operator
import threading
import types
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from dataparallel.replicate._kinds import (
    ABSENT,
    ARRAY_BYTES,
    ATOMS,
    MAX_DEPTH,
    MAX_VISITS,
    OPAQUE,
    RECORDS,
    TENSORS,
    contents,
    from_library,
    global_names,
    place_reader,
    plain_record,
)

__all__ = ["Mapping", "Pass", "rebind"]

Mapping = dict[int, Any]  # id of a tree module -> what to bind in its place
_TENSOR_KINDS = frozenset({torch.Tensor, nn.Parameter})  # (keys that may be the tree's)


def rebind(value: Any, mapping: Mapping) -> Any:
    """``value`` with every tree module in ``mapping`` (by id) replaced by its replica, where
    it is bound or held as described in the module docstring; ``value`` itself when nothing in
    it changes."""
    return Pass(mapping).rebind(value, 0)


class Pass:
    """One rebinding of a value: the mapping, a memo (each object is rebuilt once, so shared
    holders stay shared and cycles end), and a budget of objects looked into.

    ``copied`` lists each source object that was rebuilt, with what it held when it was read
    (``_kinds.contents``): a write to it later (an item set, an append) is a change the replicas
    must see, and the check compares exactly these. With ``watch``, ``walked`` lists the same
    for every holder the pass looked into and left shared (it led nowhere): a write to one
    later may make it lead to the tree (``holder.append(model)``). ``cut`` is set when the
    pass stopped short (past ``MAX_DEPTH`` or ``MAX_VISITS``): what lies beyond was
    not searched. With ``watch``, ``tensors`` lists the tensors met outside a library's state
    (their data is never walked: ``_holders.Held`` reads their version), and in ``readable``
    the numpy arrays, up to :data:`ARRAY_BYTES` of them (read by their bytes), and the
    iterators that show where they stand (``_kinds.place_reader``). ``local`` is the
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
        "readable",
        "room",
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
        self.readable: list[Any] = []  # and arrays (within ``room``) and iterators
        self.room = ARRAY_BYTES
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
        if isinstance(value, OPAQUE):
            return self._own(value) if isinstance(value, torch.Tensor) else value
        if isinstance(value, np.ndarray) and not value.dtype.hasobject:
            return self._array(value)
        if self.watch and not self.library and place_reader(kind) is not None:
            if len(self.readable) < TENSORS and id(value) not in self.memo:
                self.memo[id(value)] = value
                self.readable.append(value)  # (an iterator: read by where it stands)
            return value
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

    def _array(self, value: np.ndarray[Any, Any]) -> Any:
        """A numpy array (of numbers) is data, never walked. With ``watch``, outside a library's
        state, one that fits in what is left of :data:`ARRAY_BYTES` is recorded: it has no write
        version, so ``_holders.Held`` reads its bytes before and after each call."""
        if (
            self.watch
            and not self.library
            and value.nbytes <= self.room
            and id(value) not in self.memo
        ):
            self.memo[id(value)] = value
            self.room -= value.nbytes
            self.readable.append(value)
        return value

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
        if isinstance(value, dict):
            keys = set(map(type, value))  # (one C-level pass, as a vocabulary's is)
            if not ATOMS.issuperset(keys) or (
                self.own
                and not self.library
                and not _TENSOR_KINDS.isdisjoint(keys)
                and any([id(k) in self.own for k in value if type(k) in _TENSOR_KINDS])
            ):
                # keys that may be modules of the tree, or are its tensors (``{param: mask}``)
                return self._keyed(value, kind, deeper)
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
                held = globals_.get(name, ABSENT)
                if held is ABSENT:
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


class _Globals(dict[str, Any]):
    """A replica function's globals: the rebound names, and every other name read live from
    the script's own globals (``__missing__``), so a later assignment there is seen."""

    def __init__(self, overlay: dict[str, Any], base: dict[str, Any]) -> None:
        super().__init__(overlay)
        self.base = base

    def __missing__(self, key: str) -> Any:
        return self.base[key]
