"""Write stamps: one read that says whether any of many dictionaries was written since.

A :class:`Stamps` answers, for a fixed list of dictionaries, whether any of them was written
since it was taken, so a check that used to compare every value of every table (the replicas'
snapshot: a few hundred identities for a small CNN) first asks whether any table was written
at all, and compares only when one was. Two mechanisms, chosen once at import:

- **CPython 3.11: the version tag.** Every dictionary keeps a private version tag (PEP 509)
  that moves to a new, never reused value on every insertion, deletion or replacement of a
  value, whoever makes it: ``d[k] = v`` from Python or C, ``setattr`` on an object whose
  ``__dict__`` it is, ``update``, ``pop``, ``clear``. The tags are read at a fixed offset, in
  one gather. 3.12 deprecates the tag, and 3.13 no longer moves it when an attribute is stored
  into an object's inline values (its ``__dict__`` shares them).
- **CPython 3.12 and later: dictionary watchers** (``PyDict_AddWatcher``, the C API the
  interpreter's own optimiser uses). The dictionaries are watched; every write to any watched
  dictionary, including an attribute stored into inline values, calls one callback before it
  is made, and the callback moves one global counter. A stamp is that counter's value: a write
  to any watched table, in any tree, makes every stamp read "written" (its user then
  compares), so the answer is never "not written" after a write. A watched dictionary stays
  watched while it lives (another stamp may share it); a write to it costs the callback, about
  a microsecond. The counter moves when the callback runs, just before the write lands: a
  check made by one thread while another thread writes the tree is a race either way.

Each mechanism is used only after :func:`_works` has watched it see every kind of write the
checks rely on. Anywhere else (another interpreter, a free-threaded build, no free watcher
slot, a test that fails) :data:`AVAILABLE` is ``False``, :func:`stamps` returns ``None`` and
the callers compare everything as before: slower, never less complete.

What neither sees: a value written again with the same object (nothing changed; the watcher
sees it, the tag does not), and an ``OrderedDict``'s ``move_to_end`` (its order lives outside
the dictionary): callers compare the values of tables that are not plain dictionaries
themselves.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import sys
import sysconfig
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["AVAILABLE", "Stamps", "Watched", "stamps"]

# PyDictObject: PyObject_HEAD (refcount, type), ma_used, ma_version_tag, ...
_USED = object.__basicsize__
_TAG = _USED + ctypes.sizeof(ctypes.c_ssize_t)
_SPAN_LIMIT = 1 << 46  # a gather view wider than this: read the tags one by one instead


def _tag(d: dict[Any, Any]) -> int:
    return ctypes.c_uint64.from_address(id(d) + _TAG).value


class Stamps:
    """The version tags of ``dicts``, as of the last :meth:`take` (none at first: the owner
    takes them once it has seen the dictionaries' contents).

    Holds the dictionaries, so their addresses stay theirs while it is kept. The tags are read
    through one ``numpy`` view over the address range the dictionaries span (only the tags
    themselves are ever read), about 0.3 µs for 60 tables.
    """

    __slots__ = ("_dicts", "_index", "_saved", "_view")

    def __init__(self, dicts: list[dict[Any, Any]], borrowed: int = 0) -> None:
        # The first ``borrowed`` dictionaries are not held: their owner makes sure they are
        # alive whenever it reads (a wrapper's own ``__dict__``, which holds the stamps).
        self._dicts = dicts[borrowed:]
        addresses = np.array([id(d) + _TAG for d in dicts], dtype=np.uint64)
        base = int(np.min(addresses))
        offsets = addresses - np.uint64(base)
        span = int(np.max(offsets)) + 8
        if span > _SPAN_LIMIT or (offsets % np.uint64(8)).any():
            raise ValueError("address range")  # (caught by ``stamps``)
        self._view = np.asarray(_Memory(base, span // 8))
        # One fancy index reads them all, in address order (neighbours share pages).
        self._index = np.sort((offsets // np.uint64(8)).astype(np.intp))
        self._saved = b""  # (none taken yet: ``same`` answers ``False`` until ``take``)

    def read(self) -> bytes:
        """The tags now, as bytes (equal bytes: no table written since)."""
        return self._view[self._index].tobytes()

    def take(self) -> None:
        """Keep the tags as they are now."""
        self._saved = self.read()

    def same(self) -> bool:
        """Whether none of the dictionaries was written since :meth:`take`."""
        return self._view[self._index].tobytes() == self._saved


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


class _Probe:
    """An object with a ``__dict__``, written the way modules are."""

    def __init__(self) -> None:
        self.a = 0


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


def _moves(d: dict[Any, Any], write: Any) -> bool:
    before = _tag(d)
    write()
    return _tag(d) != before


def _works() -> bool:
    """Whether this interpreter's dictionaries have a tag where :class:`Stamps` reads it, and
    every kind of write moves it (run once, at import)."""
    if (
        sys.implementation.name != "cpython"
        or sys.version_info[:2] != (3, 11)
        or sysconfig.get_config_var("Py_GIL_DISABLED")
        or dict.__basicsize__ < _TAG + 8
    ):
        return False
    for kind in (dict, OrderedDict):
        d = kind(x=1, y=2)
        if ctypes.c_ssize_t.from_address(id(d) + _USED).value != 2:
            return False  # not the layout this module reads
        if not all(_moves(d, w) for w in _writes(d)):
            return False
    probe = _Probe()
    d = probe.__dict__
    for i in range(100):  # past the interpreter's specialisation of attribute stores
        before = _tag(d)
        probe.a = i + 1
        if _tag(d) == before:
            return False
    if not _moves(d, lambda: setattr(probe, "b", 1)) or not _moves(d, lambda: delattr(probe, "b")):
        return False
    try:
        Stamps([{}, {}, d])
    except ValueError:
        return False
    return True


# -- dictionary watchers (CPython 3.12 and later) ------------------------------------------

_DEALLOCATED = 5  # PyDict_WatchEvent: ADDED, MODIFIED, DELETED, CLONED, CLEARED, DEALLOCATED
_CALLBACK_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)
# The global write counter: moved by the callback to a value never held before (``next`` on
# one ``count`` is atomic), so a stamp that still reads its own value saw no write since.
_written: list[int] = [0]
_next_value: Callable[[], int] = itertools.count(1).__next__


def _on_write(
    event: int,
    _dict: int | None,
    _key: int | None,
    _value: int | None,
    _counter: list[int] = _written,
    _next: Callable[[], int] = _next_value,
) -> int:
    # (Pointers, not objects: a dictionary being freed is not touched. Its freeing is no
    # write: a table the snapshot holds cannot be freed.)
    if event != _DEALLOCATED:
        _counter[0] = _next()
    return 0


_CALLBACK = _CALLBACK_TYPE(_on_write)  # (kept alive as long as the interpreter)


class Watched:
    """What :class:`Stamps` answers, from dictionary watchers: the dictionaries are watched
    once, and a stamp is the global write counter's value (about 0.05 µs to read, whatever the
    number of tables). Holds the dictionaries, as :class:`Stamps` does.

    ``owners``: the objects whose ``__dict__`` is among ``dicts``. Where the interpreter does
    not tell watchers of an attribute stored into an object's inline values (CPython 3.13.0,
    python/cpython#125608, fixed in 3.13.1), each owner's dictionary is set again as its
    ``__dict__``, the same object, which moves the values into it: its attributes are then
    stored through the dictionary, which tells.
    """

    __slots__ = ("_dicts", "_saved")

    def __init__(
        self, dicts: list[dict[Any, Any]], borrowed: int = 0, owners: Iterable[object] = ()
    ) -> None:
        if _DETACH:
            for owner in owners:
                if owner is None:
                    continue  # (a dead root: its snapshot no longer matters)
                try:
                    object.__setattr__(owner, "__dict__", owner.__dict__)
                except (AttributeError, TypeError):
                    raise ValueError("an owner's __dict__ cannot be set") from None
        self._dicts = dicts[borrowed:]
        for d in dicts:
            _watch(_WATCHER, d)
        self._saved = -1  # (none taken yet: ``same`` answers ``False`` until ``take``)

    def read(self) -> int:
        """The write counter now (equal values: no watched table written since)."""
        return _written[0]

    def take(self) -> None:
        """Keep the counter as it is now."""
        self._saved = _written[0]

    def same(self) -> bool:
        """Whether no watched dictionary was written since :meth:`take`."""
        return _written[0] == self._saved


def _watch(watcher: int, d: dict[Any, Any]) -> None:
    ctypes.pythonapi.PyDict_Watch(watcher, ctypes.py_object(d))


def _store(obj: Any, value: Any) -> None:
    obj.a = value  # (one store instruction, specialised by the loops in ``_sees_every_write``)


def _sees_every_write(watcher: int, detach: bool) -> bool:
    """Whether the callback hears of every kind of write the checks rely on: to dictionaries
    and ordered ones, and to an object's attributes through every store the interpreter has
    (with the object's dictionary set again as its ``__dict__`` first, where ``detach``)."""

    def moves(write: Callable[[], object]) -> bool:
        before = _written[0]
        write()
        return _written[0] != before

    for kind in (dict, OrderedDict):
        d = kind(x=1, y=2)
        _watch(watcher, d)
        if not all(map(moves, _writes(d))):
            return False
    for _ in range(100):  # the store specialised for objects without a dictionary
        _store(_Probe(), 0)
    probe = _Probe()
    if detach:
        object.__setattr__(probe, "__dict__", probe.__dict__)
    _watch(watcher, probe.__dict__)
    writes: list[Callable[[], object]] = [
        *(lambda i=i: _store(probe, i) for i in range(1, 101)),  # and past its own
        lambda: setattr(probe, "b", 1),
        lambda: object.__setattr__(probe, "b", 2),
        lambda: probe.__dict__.__setitem__("b", 3),
        lambda: delattr(probe, "b"),
    ]
    return all(map(moves, writes))


def _watcher() -> tuple[int, bool]:
    """Our watcher's id where this interpreter has watchers and every kind of write the
    checks rely on calls it (tried once, at import), else -1; and whether owners' dictionaries
    must be set again for it to (see :class:`Watched`)."""
    if (
        sys.implementation.name != "cpython"
        or sys.version_info < (3, 12)
        or sysconfig.get_config_var("Py_GIL_DISABLED")
    ):
        return -1, False
    api = ctypes.pythonapi
    try:
        api.PyDict_AddWatcher.argtypes = [_CALLBACK_TYPE]
        api.PyDict_AddWatcher.restype = ctypes.c_int
        api.PyDict_Watch.argtypes = [ctypes.c_int, ctypes.py_object]
        api.PyDict_Watch.restype = ctypes.c_int
        api.PyDict_ClearWatcher.argtypes = [ctypes.c_int]
        api.PyDict_ClearWatcher.restype = ctypes.c_int
        watcher = int(api.PyDict_AddWatcher(_CALLBACK))
    except (AttributeError, OSError, ValueError, RuntimeError):
        return -1, False  # (no such API, or every watcher slot taken)
    try:
        for detach in (False, True):
            if _sees_every_write(watcher, detach):
                # Cleared before the interpreter tears down what the callback needs.
                atexit.register(api.PyDict_ClearWatcher, watcher)
                return watcher, detach
    except (OSError, ValueError, RuntimeError, TypeError, AttributeError):
        pass
    api.PyDict_ClearWatcher(watcher)
    return -1, False


_TAGS: bool = _works()
_WATCHER, _DETACH = (-1, False) if _TAGS else _watcher()
AVAILABLE: bool = _TAGS or _WATCHER >= 0


def stamps(
    dicts: list[dict[Any, Any]], borrowed: int = 0, owners: Iterable[object] = ()
) -> Stamps | Watched | None:
    """A :class:`Stamps` (3.11) or :class:`Watched` (3.12 and later) of ``dicts``, not taken
    yet, where this interpreter can stamp them, else ``None``. ``owners``: the objects whose
    ``__dict__`` is among them (see :class:`Watched`)."""
    if not AVAILABLE or not dicts:
        return None
    try:
        return Stamps(dicts, borrowed) if _TAGS else Watched(dicts, borrowed, owners)
    except (ValueError, OSError):
        return None
