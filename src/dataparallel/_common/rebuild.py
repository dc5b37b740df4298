"""Rebuilding a container with its own type: the one way inputs and outputs are put back.

Scatter rebuilds each chunk's arguments and gather each merged output in the containers the
user passed or the model returned: subclasses are rebuilt without calling their constructor,
their attributes and slots kept, as the guide's gather rules say. :func:`rebuild` takes the
kind and children as :func:`~dataparallel._common.kinds.struct_items` lists them; gather calls
the three builders (:func:`rebuild_sequence`, :func:`rebuild_mapping`, :func:`rebuild_record`)
directly.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from dataparallel._common.kinds import DATACLASS, RECORD, SEQUENCES, Kind, fields_of

__all__ = ["rebuild", "rebuild_mapping", "rebuild_record", "rebuild_sequence"]


def _copy_state(template: Any, new: Any) -> Any:
    """Give ``new`` the instance attributes (``__dict__`` and slots) of ``template``."""
    state = getattr(template, "__dict__", None)
    if state:
        new.__dict__.update(state)
    for name in copyreg._slotnames(type(template)):  # type: ignore[attr-defined]
        if hasattr(template, name) and not hasattr(new, name):
            object.__setattr__(new, name, getattr(template, name))
    return new


def rebuild_sequence(template: Any, values: list[Any]) -> Any:
    """A list, tuple or namedtuple of ``template``'s own type holding ``values``, its
    attributes kept.

    Namedtuples take their fields positionally. Other subclasses are rebuilt without calling
    their constructor, whose signature is theirs to choose (``Named(name, items=())`` would
    otherwise come back empty): a blank instance of the class is filled by the base type and
    given the template's attributes. Classes that forbid that (``torch.Size``) are called with
    the items.
    """
    cls: Any = type(template)
    if cls is list:
        return values
    if cls is tuple:
        return tuple(values)
    if hasattr(cls, "_fields"):
        try:
            return cls(*values)
        except TypeError:  # a subclass with its own __new__: built as _make does
            pass
    if isinstance(template, tuple):
        try:
            new = tuple.__new__(cls, values)
        except TypeError:  # a C subclass such as torch.Size: its constructor takes the items
            return cls(values)
        return _copy_state(template, new)
    new = cls.__new__(cls)
    list.__init__(new, values)
    return _copy_state(template, new)


def rebuild_mapping(template: Mapping[Any, Any], data: dict[Any, Any]) -> Any:
    """A Mapping of ``template``'s own type holding ``data`` (in order), its attributes kept.

    dict subclasses are rebuilt without calling their constructor (``Batch(meta=None, **kw)``
    would otherwise come back empty); other Mappings (``MappingProxyType``, a user class) are
    called with a dict, then filled item by item.

    Raises:
        TypeError: a Mapping class that can be built neither way.
    """
    cls: Any = type(template)
    if cls is dict:
        return data
    new: Any
    if isinstance(template, dict):
        new = cls.__new__(cls)
        if isinstance(template, OrderedDict):
            OrderedDict.__init__(new)
            OrderedDict.update(new, data)
        elif isinstance(template, defaultdict):
            defaultdict.__init__(new, template.default_factory, data)
        else:
            dict.__init__(new, data)
        return _copy_state(template, new)
    try:
        new = cls(data)
        if len(new) == len(data) and all(k in new for k in data):
            return new
    except Exception:
        pass
    try:
        new = copy.copy(template)
        for key in [k for k in new if k not in data]:
            del new[key]
        for key, value in data.items():
            new[key] = value
        return new
    except Exception as exc:
        raise TypeError(
            f"cannot rebuild a {cls.__name__} with new values ({type(exc).__name__}: {exc}); "
            f"expected a Mapping whose class accepts a dict or item assignment: pass a dict "
            f"(dict(x)) instead"
        ) from exc


def rebuild_record(
    template: Any, fields: Iterable[tuple[str, Any]], items: dict[Any, Any] | None = None
) -> Any:
    """A copy of a dataclass ``template`` with new fields (and, for a model-output class, new
    items).

    ``copy.copy`` skips ``__init__`` (``init=False`` fields, ``__post_init__``);
    ``object.__setattr__`` passes frozen dataclasses. An item that is also a field is set as
    both, as model-output classes keep them in step.
    """
    out = copy.copy(template)
    for name, value in fields:
        object.__setattr__(out, name, value)
    if items:
        names = fields_of(type(template))
        for key, value in items.items():
            if key in names:
                object.__setattr__(out, key, value)
            if isinstance(out, dict):
                dict.__setitem__(out, key, value)  # past overrides such as ModelOutput's
            else:
                out[key] = value
    return out


def rebuild(kind: Kind, template: Any, keys: list[Any], values: list[Any]) -> Any:
    """A container like ``template`` (same type, same attributes) holding ``values``.

    ``keys`` and ``values`` are as :func:`struct_items` lists them for ``kind``.
    """
    if kind in SEQUENCES:
        return rebuild_sequence(template, values)
    if kind == DATACLASS:
        return rebuild_record(template, zip(keys, values, strict=True))
    data = dict(zip(keys, values, strict=True))
    if type(template) is dict:
        return data
    if kind == RECORD or dataclasses.is_dataclass(template):
        return rebuild_record(template, (), data)
    return rebuild_mapping(template, data)
