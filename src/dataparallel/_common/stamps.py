"""Write stamps: one read that says whether any of many dictionaries was written since.

CPython keeps, in every dictionary, a private version tag (PEP 509) that moves to a
new, never reused value on every insertion, deletion or replacement of a value, whoever makes
it: ``d[k] = v`` from Python or C, ``setattr`` on an object whose ``__dict__`` it is, ``update``,
``pop``, ``clear``. A :class:`Stamps` keeps the tags of a fixed list of dictionaries and reads
them back in one gather, so a check that used to compare every value of every table (the
replicas' snapshot: a few hundred identities for a small CNN) first asks whether any table was
written at all, and compares only when one was.

The tag is an implementation detail: it is read at a fixed offset, only on CPython 3.11 to
3.13 (3.12 deprecates it; 3.14 removes it), and only after :func:`_works` has watched it move
under every kind of write the checks rely on. CPython 3.13.0 stores an attribute into an
object's inline values, which its materialised ``__dict__`` shares, without moving that
dictionary's tag (nor telling its watchers: python/cpython#125608, fixed in 3.13.1). Where
the probe finds that, each owner's dictionary is set again as its own ``__dict__`` (the same
object) before its tag is taken: the values move into the dictionary, and every later store
goes through it and moves the tag, as on 3.12. Anywhere else (another interpreter, another
version, a free-threaded build, a probe that fails) :data:`AVAILABLE` is ``False``,
:func:`stamps` returns ``None`` and the callers compare everything: slower, never less
complete.

(CPython 3.12's dictionary watchers would answer in one read, but their callback runs on
every write to a watched dictionary and on its freeing, possibly while an exception is
pending, where a callback written in Python, the only kind ``ctypes`` can register, turns
that exception into a ``SystemError``: they are not used.)

What a tag does not see: a value written again with the same object (nothing changed), and
an ``OrderedDict``'s ``move_to_end`` (its order lives outside the dictionary): callers compare
the values of tables that are not plain dictionaries themselves.
"""

from __future__ import annotations

import ctypes
import operator
import sys
import sysconfig
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["AVAILABLE", "Stamps", "stamps"]

# PyDictObject: PyObject_HEAD (refcount, type), ma_used, ma_version_tag, ...
_USED = object.__basicsize__
_TAG = _USED + ctypes.sizeof(ctypes.c_ssize_t)
_SPAN_LIMIT = 1 << 46  # a gather view wider than this: read the tags one by one instead
# From this many tables the tags are read by a ``numpy`` fancy index, not one ``itemgetter``:
# its fixed cost is higher on the caches a forward leaves, but each further table costs it
# about 1 ns against about 30 for the int ``itemgetter`` makes of each tag.
_GATHER_FROM = 96
_DETACH = False  # (set at import: whether owners' dictionaries are set again, see ``_works``)


def _tag(d: dict[Any, Any]) -> int:
    return ctypes.c_uint64.from_address(id(d) + _TAG).value


class Stamps:
    """The version tags of ``dicts``, as of the last :meth:`take` (none at first: the owner
    takes them once it has seen the dictionaries' contents).

    Holds the dictionaries, so their addresses stay theirs while it is kept. The tags are read
    through one view over the address range the dictionaries span (only the tags themselves are
    ever read), in one C call: up to :data:`_GATHER_FROM` tables by one ``itemgetter``, a tuple
    of ints (the tutorial CNN's 56 tables: 5.4 µs on the caches its forward leaves, against 8
    through ``numpy``), from there by one ``numpy`` fancy index, whose cost barely grows with
    the count (2,048 tables: 2.3 µs on warm caches, against 51 µs for the ints).

    ``owners``: the objects whose ``__dict__`` is among ``dicts``. Where the interpreter
    stores attributes past the tag (CPython 3.13.0), each one's dictionary is set again as its
    ``__dict__`` first (see the module's docstring).
    """

    __slots__ = ("_dicts", "_index", "_order", "_read", "_saved", "_view", "_words")

    def __init__(
        self, dicts: list[dict[Any, Any]], borrowed: int = 0, owners: Iterable[object] = ()
    ) -> None:
        if _DETACH:
            for owner in owners:
                if owner is not None:  # (a dead root: its snapshot no longer matters)
                    _detach(owner)
        # The first ``borrowed`` dictionaries are not held: their owner makes sure they are
        # alive whenever it reads (a wrapper's own ``__dict__``, which holds the stamps).
        self._dicts = dicts[borrowed:]
        addresses = np.array([id(d) + _TAG for d in dicts], dtype=np.uint64)
        base = int(np.min(addresses))
        offsets = addresses - np.uint64(base)
        span = int(np.max(offsets)) + 8
        if span > _SPAN_LIMIT or (offsets % np.uint64(8)).any():
            raise ValueError("address range")  # (caught by ``stamps``)
        # The span as 64-bit words, and the tags' places in it in address order (neighbours
        # share pages): one ``itemgetter`` of them (a second place read twice where there is
        # one table: always a tuple), or, for many tables, one fancy index.
        view: Any = np.asarray(_Memory(base, span // 8))
        self._view = view
        self._index = np.sort((offsets // np.uint64(8)).astype(np.intp))
        # each read place's dictionary, by its index in ``dicts`` (``moved``)
        self._order: list[int] = np.argsort(offsets, kind="stable").tolist()
        self._words = memoryview(view).cast("B").cast("Q")
        self._read: Callable[[memoryview], tuple[int, ...]] | None = None
        if len(dicts) < _GATHER_FROM:
            places = [int(i) for i in self._index]
            self._read = operator.itemgetter(*places, places[0])
        # (none taken yet: ``same`` answers ``False`` until ``take``)
        self._saved: tuple[int, ...] | bytes = b""

    def read(self) -> tuple[int, ...] | bytes:
        """The tags now (equal reads: no table written since): a tuple of ints, or their
        bytes where there are many."""
        if self._read is None:
            return self._view[self._index].tobytes()
        return self._read(self._words)

    def take(self) -> None:
        """Keep the tags as they are now."""
        self._saved = self.read()

    def moved(self) -> list[int]:
        """The indices in ``dicts`` of the dictionaries written since :meth:`take` (all of
        them before the first), in order: what :meth:`same` answers, one by one."""
        now, saved = self.read(), self._saved
        order = self._order
        if not saved:
            return sorted(order)
        if isinstance(now, bytes) and isinstance(saved, bytes):
            places = np.flatnonzero(
                np.frombuffer(now, np.uint64) != np.frombuffer(saved, np.uint64)
            ).tolist()
        else:
            places = [p for p in range(len(order)) if now[p] != saved[p]]
        return sorted(order[p] for p in places)

    def same(self) -> bool:
        """Whether none of the dictionaries was written since :meth:`take`."""
        read = self._read
        if read is None:
            return self._view[self._index].tobytes() == self._saved
        return read(self._words) == self._saved


class _Memory:
    """``count`` 64-bit words from ``address``, for ``numpy.asarray`` (read-only; no ctypes
    array type is made per view, so nothing is left for the garbage collector)."""

    def __init__(self, address: int, count: int) -> None:
        self.__array_interface__ = {
            "data": (address, True),
            "shape": (count,),
            "typestr": "<u8",
            "version": 3,
        }


def _detach(owner: object) -> None:
    """Set ``owner``'s dictionary again as its ``__dict__``: the same object, now holding the
    values itself (``ValueError`` where it cannot be set)."""
    try:
        object.__setattr__(owner, "__dict__", owner.__dict__)
    except (AttributeError, TypeError):
        raise ValueError("an owner's __dict__ cannot be set") from None


def stamps(
    dicts: list[dict[Any, Any]], borrowed: int = 0, owners: Iterable[object] = ()
) -> Stamps | None:
    """A :class:`Stamps` of ``dicts`` (not taken yet) where tags are readable here, else
    ``None``. ``owners``: the objects whose ``__dict__`` is among them."""
    if not AVAILABLE or not dicts:
        return None
    try:
        return Stamps(dicts, borrowed, owners)
    except ValueError:
        return None


class _Probe:
    """An object with a ``__dict__``, written the way modules are."""

    def __init__(self) -> None:
        self.a = 0


def _store(obj: Any, value: Any) -> None:
    obj.a = value  # (one store instruction, specialised by the loops in ``_sees_every_write``)


def _writes(d: dict[Any, Any]) -> list[Callable[[], object]]:
    """Every kind of write to a dictionary holding ``x`` and ``y``, in an order that works."""
    return [
        lambda: d.__setitem__("x", object()),
        lambda: d.__setitem__("z", 3),
        lambda: d.__delitem__("z"),
        lambda: d.pop("y"),
        lambda: d.setdefault("w", 4),
        lambda: d.update(v=5),
        lambda: d.popitem(),
        lambda: d.clear(),
    ]


def _sees_every_write(detach: bool) -> bool:
    """Whether the tag moves under every kind of write the checks rely on: to dictionaries
    and ordered ones, and to an object's attributes through every store the interpreter has
    (with the object's dictionary set again as its ``__dict__`` first, where ``detach``)."""
    d: dict[Any, Any] = {}

    def moves(write: Callable[[], object]) -> bool:
        before = _tag(d)
        write()
        return _tag(d) != before

    for kind in (dict, OrderedDict):
        d = kind(x=1, y=2)
        if ctypes.c_ssize_t.from_address(id(d) + _USED).value != 2:
            return False  # not the layout this module reads
        if not all(map(moves, _writes(d))):
            return False
    for _ in range(100):  # the store specialised for objects without a dictionary
        _store(_Probe(), 0)
    probe = _Probe()
    if detach:
        _detach(probe)
    d = probe.__dict__
    writes: list[Callable[[], object]] = [
        *(lambda i=i: _store(probe, i) for i in range(1, 101)),  # and past its own
        lambda: setattr(probe, "b", 1),
        lambda: object.__setattr__(probe, "b", 2),
        lambda: probe.__dict__.__setitem__("b", 3),
        lambda: delattr(probe, "b"),
    ]
    return all(map(moves, writes))


def _works() -> tuple[bool, bool]:
    """Whether this interpreter's dictionaries have a tag where :class:`Stamps` reads it and
    every kind of write moves it, and whether owners' dictionaries must be set again for that
    (run once, at import)."""
    if (
        sys.implementation.name != "cpython"
        or not (3, 11) <= sys.version_info[:2] <= (3, 13)
        or sysconfig.get_config_var("Py_GIL_DISABLED")
        or dict.__basicsize__ < _TAG + 8
    ):
        return False, False
    for detach in (False, True):
        try:
            if _sees_every_write(detach):
                Stamps([{}, {}, {}])
                return True, detach
        except ValueError:
            return False, False
    return False, False


_WORKS, _DETACH = _works()
AVAILABLE: bool = _WORKS
