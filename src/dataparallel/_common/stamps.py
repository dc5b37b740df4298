"""Write stamps: one read that says whether any of many dictionaries was written since.

CPython keeps, in every dictionary, a private version tag (PEP 509) that moves to a
new, never reused value on every insertion, deletion or replacement of a value, whoever makes
it: ``d[k] = v`` from Python or C, ``setattr`` on an object whose ``__dict__`` it is, ``update``,
``pop``, ``clear``. A :class:`Stamps` keeps the tags of a fixed list of dictionaries and reads
them back in one gather, so a check that used to compare every value of every table (the
replicas' snapshot: a few hundred identities for a small CNN) first asks whether any table was
written at all, and compares only when one was.

The tag is an implementation detail: it is read at a fixed offset, only on CPython 3.11 (the
version the project runs and tests: 3.12 deprecates the tag, and 3.13 keeps instance attributes
apart from their dictionary), and only after :func:`_works` has watched it move under every
kind of write the checks rely on. Anywhere else (another interpreter, another version, a
free-threaded build, a test that fails) :data:`AVAILABLE` is ``False``, :func:`stamps` returns
``None`` and the callers compare everything as before: slower, never less complete.

What a tag does not see: a value written again with the same object (nothing changed), and
an ``OrderedDict``'s ``move_to_end`` (its order lives outside the dictionary): callers compare
the values of tables that are not plain dictionaries themselves.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["AVAILABLE", "Stamps", "stamps"]

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


def stamps(dicts: list[dict[Any, Any]], borrowed: int = 0) -> Stamps | None:
    """A :class:`Stamps` of ``dicts`` (not taken yet) where tags are readable here, else
    ``None``."""
    if not AVAILABLE or not dicts:
        return None
    try:
        return Stamps(dicts, borrowed)
    except ValueError:
        return None


class _Probe:
    """An object with a ``__dict__``, written the way modules are."""

    def __init__(self) -> None:
        self.a = 0


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
        writes = [
            lambda d=d: d.__setitem__("x", object()),
            lambda d=d: d.__setitem__("z", 3),
            lambda d=d: d.__delitem__("z"),
            lambda d=d: d.pop("y"),
            lambda d=d: d.setdefault("w", 4),
            lambda d=d: d.update(v=5),
            lambda d=d: d.popitem(),
            lambda d=d: d.clear(),
        ]
        if not all(_moves(d, w) for w in writes):
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


AVAILABLE: bool = _works()
