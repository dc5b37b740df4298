"""The holders a replica set watches, each compared at a cost that does not grow with its data.

The rebinding search (``_copy.Pass``) records every holder it read: a write to one since (a
list that led nowhere, later given a module of the tree) means the module's replicas must be
refilled. Comparing every item of every holder on every call made a model that only carries
data pay for it: a vocabulary dict of 50,000 words, an index-to-word list, a logging hook's
history that grows by one record per call. So each holder is compared by what is cheapest
and still sees the writes that matter:

- a dictionary by its write version (``torch._C._dynamo.guards.dict_version``, which moves on
  every insertion, deletion or replacement), in one read; its items only when it moved;
- a large list (over :data:`BIG` items) by its length, its last item and its items at
  :data:`SAMPLES` fixed places (chosen again each time it grew by one spacing of them); one
  that only grew (``history.append(record)``) is searched in its new part only, and, when that
  part leads to no module of the tree and the replicas share the list (the search left it as
  it is), taken as it is now without a refill (a list the replicas hold copies of, one that
  holds a module of the tree, is refilled: their copies lack the new items);
- a function by its own part (code, cells, defaults) item by item, its attributes
  (``hook.calls += 1``) by its ``__dict__``'s write version after the call, and the globals it reads
  by its module's dictionary's write version, in one read; when that moved (a script's loop at
  module level writes it on every step), by name, from the list of names kept with it; a
  global that changed from one plain value to another (a step counter) is taken as it is now,
  without a refill (nothing of the tree is rebound in its place);
- anything else (small holders, objects) item by item, as before; one the replicas share that
  changed by plain values alone (a counter in a stats dict, a young history's new records) is
  taken as it is now, without a refill.

What this does not see: an item replaced in the middle of a large list, away from the places
compared (the guide says so).
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dataparallel.replicate._copy import Mapping, Pass
from dataparallel.replicate._kinds import (
    ABSENT,
    contents,
    function_own,
    global_names,
    place_reader,
    plain_record,
)

__all__ = ["BIG", "PLAIN_GLOBALS", "SAMPLES", "Held"]

BIG = 256  # a list longer than this is compared by length and samples
SAMPLES = 32
# A function's global whose value changes between two plain values of these types needs no
# refill (``Held._plain_globals``). Not tensors: a parameter of the tree read as a global is
# rebound to the replicas' own.
PLAIN_GLOBALS = frozenset((bool, int, float, complex, str, bytes, type(None), torch.dtype))


def _dict_version_reader() -> Callable[[dict[Any, Any]], int] | None:
    """torch's reader of a dictionary's write version, where it is there and moves."""
    try:
        from torch._C._dynamo.guards import dict_version
    except ImportError:  # pragma: no cover - a torch without dynamo's guards
        return None
    probe: dict[str, int] = {}
    before = dict_version(probe)
    probe["x"] = 1
    moved = dict_version(probe)
    del probe["x"]
    if before == moved or dict_version(probe) == moved:  # pragma: no cover
        return None
    reader: Callable[[dict[Any, Any]], int] = dict_version
    return reader


_VERSION = _dict_version_reader()
_DICT_ITER = dict.__iter__
_BYTES = operator.methodcaller("tobytes")


def _plain_change(obj: Any, held: list[Any], now: list[Any]) -> bool:
    """Whether a holder the replicas share changed by plain values alone: the same length,
    each changed item a plain value before and after (a counter in a stats dict), or a list
    that only grew by plain values and plain records (a young history). Such a change leads
    to no module: the replicas read the holder itself, as it is now."""
    if len(now) == len(held):
        return all(
            type(a) in PLAIN_GLOBALS and type(b) in PLAIN_GLOBALS
            for a, b in zip(now, held, strict=True)
            if a is not b
        )
    return (
        type(obj) is list
        and len(now) > len(held)
        and all(map(operator.is_, now, held))
        and all(type(v) in PLAIN_GLOBALS or plain_record(v, type(v)) for v in now[len(held) :])
    )


class Held:
    """One watched holder: the object, what it held when read (identities), and the cheap
    state it is compared by first (a dictionary's version, a large list's samples)."""

    __slots__ = (
        "at",
        "attrs",
        "bare",
        "defaults",
        "held",
        "names",
        "obj",
        "own",
        "read",
        "sample",
        "sampled",
        "shared",
        "version",
    )

    def __init__(self, obj: Any, held: list[Any], shared: bool = False) -> None:
        self.obj = obj
        self.held = held
        # Data the replicas share (not a parameter or buffer of the tree: a plain tensor
        # attribute, a cache in a list, a small numpy array): watched by one reading alone, as
        # of the last read (a tensor's version; an array's bytes, since it has no version; where
        # an iterator stands).
        self.read: Callable[[Any], Any] | None = (
            _tensor_version
            if isinstance(obj, torch.Tensor)
            else _BYTES
            if isinstance(obj, np.ndarray)
            else place_reader(type(obj))
        )
        # Left shared by the search (it led nowhere): the replicas read this very object. A
        # holder it copied (it leads to the tree) has a copy per replica, which a write to
        # the original, of anything, leaves behind: only a refill brings it along.
        self.shared = shared
        self.version: Any = None  # (an int; an array's bytes)
        self.sample: Callable[[Any], Any] | None = None
        self.own = 0  # a function's: how many of ``held`` are its own (``function_own``)
        # A function without cells or keyword defaults (most hooks and methods): its own part
        # is its code and its defaults' tuple, compared by identity (``bare``).
        self.bare = False
        self.defaults: tuple[Any, ...] | None = None
        self.names: list[str] = []  # a function's globals, in ``contents``' order
        self.attrs: int | None = None  # a function's ``__dict__``'s version, at the sync
        self.sampled: tuple[Any, ...] = ()  # a large list's held items at the sampled places
        self.at = 0  # a large list's length when its places were chosen
        self._cheap()

    def _cheap(self) -> None:
        obj = self.obj
        if self.read is not None:
            self.version = self.read(obj)
        elif (
            _VERSION is not None
            and isinstance(obj, dict)
            and (self.shared or type(obj).__iter__ is _DICT_ITER)
        ):
            # (A copied dict whose order is not its storage's, an ``OrderedDict``, is compared
            # item by item: ``move_to_end`` reorders it without moving the version, and its
            # copies keep the old order. One left shared is the replicas' own: a tokenizer's
            # vocabulary is read by its version.)
            self.version = _VERSION(obj)
        elif _VERSION is not None and isinstance(obj, types.FunctionType):
            # Its globals are its module's dictionary's values: unchanged while that
            # dictionary's version is (a global rebound, added or deleted moves it).
            self.version = _VERSION(obj.__globals__)
            self.attrs = _VERSION(obj.__dict__)
            self.own = len(function_own(obj))
            # (``__closure__`` cannot be set, and a code swapped in keeps its free variables.)
            self.bare = obj.__closure__ is None and obj.__kwdefaults__ is None
            self.defaults = obj.__defaults__
            self.names = sorted(global_names(obj.__code__)[0])
        elif isinstance(obj, list) and len(obj) > BIG:
            n = self.at = len(obj)
            places = sorted({*range(0, n, max(1, n // SAMPLES)), n - 1})
            self.sample = operator.itemgetter(*places)
            # Side by side: the held copy's places lie apart in memory, one read each per call.
            self.sampled = self.sample(self.held)

    def still(self, probe: Mapping) -> bool:
        """Whether the holder holds what it held, or only grew by items that lead to no module
        of the tree (``probe``: the tree's module ids); then taken as it is now."""
        obj = self.obj
        if self.read is not None:  # (its identity is its holder's to compare: only read)
            self.version = self.read(obj)
            return True
        version = self.version
        if version is not None:
            own = self.own
            if not own:
                if _VERSION is not None and _VERSION(obj) == version:
                    return True
            elif _VERSION is not None:
                # (its attributes as they are now: what forward writes there is read after)
                self.attrs = _VERSION(obj.__dict__)
                # Its own part: the same code and defaults' tuple (a tuple's items cannot
                # change), and still no keyword defaults; else compared item by item.
                if not (
                    self.bare
                    and obj.__code__ is self.held[0]
                    and obj.__defaults__ is self.defaults
                    and obj.__kwdefaults__ is None
                ):
                    now = function_own(obj)
                    if len(now) != own or not all(map(operator.is_, now, self.held)):
                        return False
                g = obj.__globals__
                moved = _VERSION(g)
                if moved == version:
                    return True
                # Its module's dictionary written (a script's loop at module level writes it
                # on every step): the globals it reads, by name (its code is the same).
                names, rest = self.names, self.held[own:]
                if len(names) != len(rest):
                    return False
                now = [g.get(n, ABSENT) for n in names]
                if not all(map(operator.is_, now, rest)) and not self._plain_globals(now):
                    return False
                self.version = moved
                return True
        elif self.sample is not None:
            return self._list_still(obj, probe)
        now = contents(obj)
        held = self.held
        if len(now) != len(held) or not all(map(operator.is_, now, held)):
            if not (self.shared and _plain_change(obj, held, now)):
                return False
            # A young history, a counter: taken as it is now, and compared from now on by
            # what is cheapest for it (a history past BIG items by its samples)
            self.held = now
            self._cheap()
        elif version is not None:  # written back to what it held
            self._cheap()
        return True

    def written(self) -> bool:
        """Whether the holder was written since :meth:`still` last read it: read right after
        the replicas ran, a write their forwards made. By the cheap state alone: a dictionary's
        version, a list's length and last item, a small holder's contents, a function's cells,
        defaults and the globals it reads (a hook's ``nonlocal count; count += 1``, or its
        ``global``); a large holder of another kind is not read."""
        obj, held = self.obj, self.held
        if self.read is not None:
            return bool(self.read(obj) != self.version)
        if isinstance(obj, dict) and self.version is not None:
            return _VERSION(obj) != self.version  # type: ignore[misc]
        if isinstance(obj, list):
            n = len(held)
            return len(obj) != n or (n > 0 and obj[n - 1] is not held[n - 1])
        if isinstance(obj, types.FunctionType):
            return self._function_written(obj)
        if len(held) > BIG:
            return False
        now = contents(obj)
        return len(now) != len(held) or not all(map(operator.is_, now, held))

    def _function_written(self, obj: types.FunctionType) -> bool:
        """:meth:`written` for a function: its own part (code, cells, defaults) by identity,
        its attributes by its ``__dict__``'s version (a hook's ``count_rows.calls += 1``), and
        the globals it reads by name only where its module's dictionary was written since
        :meth:`still` read it (a script's loop writes it on every step, before the call)."""
        held, own = self.held, self.own
        if not own:  # (no dictionary versions to read: its own part alone)
            now = function_own(obj)
            return len(now) > len(held) or not all(map(operator.is_, now, held))
        if _VERSION(obj.__dict__) != self.attrs:  # type: ignore[misc]
            return True
        if self.bare:
            if (
                obj.__code__ is not held[0]
                or obj.__defaults__ is not self.defaults
                or obj.__kwdefaults__ is not None
            ):
                return True
        else:
            now = function_own(obj)
            if len(now) != own or not all(map(operator.is_, now, held)):
                return True
        g = obj.__globals__
        if _VERSION(g) == self.version:  # type: ignore[misc]
            return False
        return not all(map(operator.is_, [g.get(n, ABSENT) for n in self.names], held[own:]))

    def _plain_globals(self, now: list[Any]) -> bool:
        """Whether every global of a function that changed (``now`` against the held ones,
        by name) was a plain value before and is one now (a script's step counter, a learning
        rate); then they are taken as they are now. Such a value leads to no module, before
        or after, and is never rebound: a replica's function reads it from the module's
        dictionary, live, as the function itself does (``_copy``'s ``_Globals``)."""
        held, own = self.held, self.own
        changed = [i for i, value in enumerate(now) if value is not held[own + i]]
        if not all(
            type(now[i]) in PLAIN_GLOBALS and type(held[own + i]) in PLAIN_GLOBALS for i in changed
        ):
            return False
        for i in changed:
            held[own + i] = now[i]
        return True

    def _list_still(self, obj: list[Any], probe: Mapping) -> bool:
        held = self.held
        n = len(held)
        sample = self.sample
        if len(obj) < n or sample is None:
            return False
        # The sampled places, and the last item (the places are chosen again only once the
        # list grew by one spacing of them).
        if obj[n - 1] is not held[n - 1] or not all(map(operator.is_, sample(obj), self.sampled)):
            return False
        if len(obj) == n:
            return True
        if not self.shared:  # each replica's own copy lacks the new items
            return False
        # Grown: the old part the same where compared, the new part searched alone.
        new = obj[n:]
        search: Pass | None = None  # made for the first item that is not a plain record
        for item in new:
            if plain_record(item, type(item)):
                continue
            if search is None:
                search = Pass(probe, watch=True)
            if search.rebind(item, 1) is not item:
                return False
        # (cut: too large to search; walked: new holders of their own: search it all)
        if search is not None and (search.cut or search.walked):
            return False
        held.extend(new)
        if len(held) - self.at >= max(1, self.at // SAMPLES):
            self._cheap()  # new places once it grew by one spacing of them (a history: rarely)
        return True


def _tensor_version(tensor: torch.Tensor) -> int:
    """``tensor._version``; ``-1`` for an inference tensor, which has none (and cannot be
    written outside inference mode)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1
