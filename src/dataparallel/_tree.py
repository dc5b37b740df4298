"""Nested structures: what counts as a container, how to take one apart and put it back.

Scatter, gather and the distributed helpers all walk the same kinds of containers: tuples,
namedtuples, lists, Mappings (dicts, OrderedDicts, model-output classes) and dataclasses. This
module is the one place that knows how to list their children, name their paths
(``args[1]['boxes']``, ``output.logits``) and rebuild them with their own type.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dataparallel.markers import Shared, Split

__all__ = [
    "MAX_DEPTH",
    "TooDeep",
    "describe",
    "is_dataclass_instance",
    "map_tensors",
    "rebuild",
    "rebuild_mapping",
    "rebuild_sequence",
    "struct_items",
]

# Kinds of containers.
TUPLE = "tuple"
NAMEDTUPLE = "namedtuple"
LIST = "list"
MAPPING = "mapping"
DATACLASS = "dataclass"


def is_dataclass_instance(obj: Any) -> bool:
    """True for dataclass instances (not dataclass types)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def container_kind(obj: Any) -> str | None:
    """The container kind of ``obj``, or ``None`` for a leaf.

    Mappings are checked before dataclasses, so model-output classes (an ``OrderedDict`` that is
    also a dataclass) are walked by key, as their users index them.
    """
    if isinstance(obj, tuple):
        return NAMEDTUPLE if hasattr(type(obj), "_fields") else TUPLE
    if isinstance(obj, list):
        return LIST
    if isinstance(obj, Mapping):
        return MAPPING
    if is_dataclass_instance(obj):
        return DATACLASS
    return None


def struct_items(obj: Any, kind: str) -> tuple[list[Any], list[Any]]:
    """The keys and values of a container of the given kind, in order."""
    if kind == MAPPING:
        return list(obj.keys()), list(obj.values())
    if kind == DATACLASS:
        names = [f.name for f in dataclasses.fields(obj)]
        return names, [getattr(obj, n) for n in names]
    if kind == NAMEDTUPLE:
        return list(type(obj)._fields), list(obj)
    return list(range(len(obj))), list(obj)


def path_key(kind: str, key: Any) -> str:
    """The path suffix of one child: ``[0]``, ``['boxes']`` or ``.logits``."""
    if kind in (DATACLASS, NAMEDTUPLE):
        return f".{key}"
    return f"[{key!r}]"


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
    """A list or tuple of ``template``'s own type holding ``values``, its attributes kept.

    Subclasses are rebuilt without calling their constructor, whose signature is theirs to
    choose (``Named(name, items=())`` would otherwise come back empty): a blank instance of the
    class is filled by the base type and given the template's attributes. Classes that forbid
    that (``torch.Size``) are called with the items.
    """
    cls: Any = type(template)
    if cls is list:
        return values
    if cls is tuple:
        return tuple(values)
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


def rebuild(kind: str, template: Any, keys: list[Any], values: list[Any]) -> Any:
    """A container like ``template`` (same type, same attributes) holding ``values``.

    Dataclasses are copied and their fields set with ``object.__setattr__``, so frozen ones and
    ones with ``init=False`` fields come back whole.
    """
    if kind in (TUPLE, LIST):
        return rebuild_sequence(template, values)
    if kind == NAMEDTUPLE:
        try:
            return type(template)(*values)
        except TypeError:  # a subclass with its own __new__: build it as _make does
            return rebuild_sequence(template, values)
    if kind == MAPPING:
        if type(template) is dict:
            return dict(zip(keys, values, strict=True))
        if is_dataclass_instance(template):
            new = copy.copy(template)
            for key, value in zip(keys, values, strict=True):
                new[key] = value
            return new
        return rebuild_mapping(template, dict(zip(keys, values, strict=True)))
    # DATACLASS
    new = copy.copy(template)
    for key, value in zip(keys, values, strict=True):
        object.__setattr__(new, key, value)
    return new


# Containers nested deeper than this are refused: Python's stack is finite, and a container
# that contains itself would otherwise recurse until it overflows.
MAX_DEPTH = 100


class TooDeep(ValueError):
    """Containers nested more than ``MAX_DEPTH`` levels deep, or a cycle."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        super().__init__(
            f"{path or 'input'}: containers nested more than {MAX_DEPTH} levels deep, or a "
            f"container that contains itself, expected a tree; flatten the input, or pass a "
            f"copy without the back-reference"
        )


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    shared_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    _depth: int = 0,
) -> Any:
    """Apply ``fn`` to every tensor inside nested containers; markers are unwrapped.

    Tensors inside a ``dp.Shared`` get ``shared_fn`` instead (scatter moves them without
    casting them); other leaves are returned as they are (shared by reference).

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _depth > MAX_DEPTH:
        raise TooDeep
    if isinstance(obj, Shared):
        inner = fn if shared_fn is None else shared_fn
        return map_tensors(obj.obj, inner, inner, _depth + 1)
    if isinstance(obj, Split):
        return map_tensors(obj.obj, fn, shared_fn, _depth + 1)
    kind = container_kind(obj)
    if kind is None:
        return obj
    keys, values = struct_items(obj, kind)
    depth = _depth + 1
    return rebuild(kind, obj, keys, [map_tensors(v, fn, shared_fn, depth) for v in values])


def contains_array(obj: Any, _depth: int = 0) -> bool:
    """True when a tensor or ndarray lies anywhere inside ``obj``.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    if isinstance(obj, torch.Tensor) or _is_ndarray(obj):
        return True
    if _depth > MAX_DEPTH:
        raise TooDeep
    if isinstance(obj, (Shared, Split)):
        return contains_array(obj.obj, _depth + 1)
    kind = container_kind(obj)
    if kind is None:
        return False
    return any(contains_array(v, _depth + 1) for v in struct_items(obj, kind)[1])


def _is_ndarray(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray"


def describe(obj: Any) -> str:
    """A short description of a value for plans and messages: ``Tensor[10, 3] float32``."""
    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        where = "" if obj.device.type == "cpu" else f" {obj.device}"
        return f"Tensor[{', '.join(map(str, obj.shape))}] {dtype}{where}"
    if _is_ndarray(obj):
        return f"ndarray[{', '.join(map(str, obj.shape))}] {obj.dtype}"
    if isinstance(obj, Shared):
        return f"Shared({describe(obj.obj)})"
    if isinstance(obj, Split):
        return f"Split({describe(obj.obj)})"
    if isinstance(obj, (list, tuple)):
        name = type(obj).__name__
        if not obj:
            return f"{name}[0]"
        kinds = sorted(
            {type(x).__name__ if not isinstance(x, torch.Tensor) else "Tensor" for x in obj}
        )
        return f"{name}[{len(obj)}] of {'/'.join(kinds)}"
    if isinstance(obj, Mapping):
        return f"{type(obj).__name__} with {len(obj)} keys"
    if isinstance(obj, (str, bytes)):
        text = repr(obj)
        return text if len(text) <= 24 else text[:21] + "..."
    if obj is None or isinstance(obj, (bool, int, float, complex)):
        return repr(obj)
    return type(obj).__name__
