"""Nested structures: one vocabulary of container kinds, flatten with paths, rebuild, map.

Plan, scatter, gather and the distributed helpers all walk the same containers: tuples,
namedtuples, lists, Mappings (dicts, OrderedDicts, ``MappingProxyType``, model-output classes)
and dataclasses. This module is the one place that classifies a value (:func:`kind_of`, one
dict lookup per class), lists a container's children in order (:func:`struct_items`: dict order
as given, never sorted), names their paths (``args[1]['boxes']``, ``output.logits``), rebuilds a
container with its own type (:func:`rebuild`: subclasses without calling their constructor,
attributes and slots kept, as the guide's gather rules say) and walks whole trees
(:func:`flatten`, :func:`unflatten`, :func:`leaves`, :func:`map_leaves`, :func:`map_tensors`),
refusing cycles and nesting deeper than ``MAX_DEPTH`` with :class:`TooDeep`.

The kinds are strings, the same for inputs and outputs. :func:`kind_of` gives the full kind
(gather dispatches on it); :func:`container_kind` gives the kind a walker sees, or ``None`` for
a leaf: a model-output class (``RECORD``, a Mapping that is also a dataclass) is walked by key
as a ``MAPPING``, as its users index it, and a ``torch.Size`` (``SHAPE``) as a ``TUPLE``.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import numbers
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from dataparallel.markers import Shared, Split

__all__ = [
    "ARRAY",
    "ATOMS",
    "BOOL",
    "DATACLASS",
    "LIST",
    "MAPPING",
    "MAX_DEPTH",
    "NAMEDTUPLE",
    "NONE",
    "NUMBER",
    "OTHER",
    "RECORD",
    "SHAPE",
    "STRUCTURES",
    "TENSOR",
    "TUPLE",
    "Kind",
    "TooDeep",
    "TreeSpec",
    "container_kind",
    "contains_array",
    "describe",
    "fields_of",
    "flatten",
    "item_types",
    "kind_of",
    "leaves",
    "map_leaves",
    "map_tensors",
    "path_key",
    "rebuild",
    "rebuild_mapping",
    "rebuild_record",
    "rebuild_sequence",
    "struct_items",
    "unflatten",
]

# Exact types of plain leaves (names, ids, numbers): nothing inside to move, cut or unwrap.
ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})

Kind = str

# The kinds of values. Leaves:
NONE: Kind = "none"
TENSOR: Kind = "tensor"
ARRAY: Kind = "ndarray"
BOOL: Kind = "bool"
NUMBER: Kind = "number"
SHAPE: Kind = "shape"  # torch.Size: a value when gathered, a tuple of ints when walked
OTHER: Kind = "other"
# Containers:
LIST: Kind = "list"
TUPLE: Kind = "tuple"
NAMEDTUPLE: Kind = "namedtuple"
MAPPING: Kind = "mapping"
DATACLASS: Kind = "dataclass"
RECORD: Kind = "record"  # a Mapping that is also a dataclass: a model-output class
STRUCTURES = frozenset((LIST, TUPLE, NAMEDTUPLE, MAPPING, DATACLASS, RECORD))

# What a walker sees of each kind; absent kinds are leaves.
_WALKED: dict[Kind, Kind] = {
    LIST: LIST,
    TUPLE: TUPLE,
    NAMEDTUPLE: NAMEDTUPLE,
    SHAPE: TUPLE,
    MAPPING: MAPPING,
    RECORD: MAPPING,
    DATACLASS: DATACLASS,
}
_SEQUENCES = frozenset((LIST, TUPLE, NAMEDTUPLE, SHAPE))

_KINDS: dict[type, Kind] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
_MAX_CACHED = 4096  # classes made on the fly (a namedtuple per call) must not grow it forever

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


# ---------------------------------------------------------------------------- the kinds


def _classify(cls: type) -> Kind:
    if cls is type(None):
        return NONE
    if issubclass(cls, torch.Tensor):
        return TENSOR
    if issubclass(cls, np.ndarray):
        return ARRAY
    if issubclass(cls, (bool, np.bool_)):
        return BOOL
    if issubclass(cls, numbers.Complex):  # int, float, complex, Fraction, numpy numbers
        return NUMBER
    if issubclass(cls, torch.Size):  # a shape is a value, not a tuple of numbers to average
        return SHAPE
    if issubclass(cls, list):
        return LIST
    if issubclass(cls, tuple):
        return NAMEDTUPLE if hasattr(cls, "_fields") else TUPLE
    is_dataclass = dataclasses.is_dataclass(cls)
    if issubclass(cls, Mapping):
        return RECORD if is_dataclass else MAPPING
    return DATACLASS if is_dataclass else OTHER


def kind_of(obj: Any, /) -> Kind:
    """The kind of ``obj``: its class is classified once, then found with one dict lookup.

    >>> kind_of([1]), kind_of({"a": 1}), kind_of(torch.zeros(1)), kind_of("text")
    ('list', 'mapping', 'tensor', 'other')
    """
    cls = type(obj)
    kind = _KINDS.get(cls)
    if kind is None:
        if len(_KINDS) >= _MAX_CACHED:
            _KINDS.clear()
        kind = _KINDS[cls] = _classify(cls)
    return kind


def container_kind(obj: Any, /) -> Kind | None:
    """The kind a walker sees: ``LIST``, ``TUPLE``, ``NAMEDTUPLE``, ``MAPPING`` or ``DATACLASS``,
    or ``None`` for a leaf.

    Mappings come before dataclasses, so model-output classes (an ``OrderedDict`` that is also
    a dataclass) are walked by key, as their users index them.
    """
    return _WALKED.get(kind_of(obj))


def fields_of(cls: type, /) -> tuple[str, ...]:
    """The field names of a dataclass type, cached per class."""
    names = _FIELDS.get(cls)
    if names is None:
        if len(_FIELDS) >= _MAX_CACHED:
            _FIELDS.clear()
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def struct_items(obj: Any, kind: Kind) -> tuple[list[Any], list[Any]]:
    """The keys and values of a container of the given kind, in order (dict order as given)."""
    if kind in (MAPPING, RECORD):
        return list(obj.keys()), list(obj.values())
    if kind == DATACLASS:
        names = fields_of(type(obj))
        return list(names), [getattr(obj, n) for n in names]
    if kind == NAMEDTUPLE:
        return list(type(obj)._fields), list(obj)
    return list(range(len(obj))), list(obj)


def item_types(items: Iterable[Any], /) -> set[type]:
    """``set(map(type, items))``: the exact types of ``items``, read once each.

    Most per-sample lists hold one type. Counting the first item's type among them (identity
    first, as a set compares too) answers those about a third faster than hashing every type
    into a set; a mix of types is then put in a set. Both give the same set for any classes
    whose ``==`` agrees with their hash, as Python requires.
    """
    types = list(map(type, items))
    if types and types.count(types[0]) == len(types):
        return {types[0]}
    return set(types)


def path_key(kind: Kind, key: Any) -> str:
    """The path suffix of one child: ``[0]``, ``['boxes']`` or ``.logits``."""
    if kind in (DATACLASS, NAMEDTUPLE):
        return f".{key}"
    return f"[{key!r}]"


# ---------------------------------------------------------------------------- rebuild


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
    if kind in _SEQUENCES:
        return rebuild_sequence(template, values)
    if kind == DATACLASS:
        return rebuild_record(template, zip(keys, values, strict=True))
    data = dict(zip(keys, values, strict=True))
    if type(template) is dict:
        return data
    if kind == RECORD or dataclasses.is_dataclass(template):
        return rebuild_record(template, (), data)
    return rebuild_mapping(template, data)


# ---------------------------------------------------------------------------- walks


class TreeSpec:
    """The shape of a flattened tree: each container's kind, template and keys; ``None``
    children are leaves. :func:`unflatten` puts new leaves back into it."""

    __slots__ = ("children", "keys", "kind", "template")

    def __init__(
        self, kind: Kind, template: Any, keys: list[Any], children: list[TreeSpec | None]
    ) -> None:
        self.kind, self.template, self.keys, self.children = kind, template, keys, children

    @property
    def num_leaves(self) -> int:
        """How many leaves the tree has."""
        return sum(1 if c is None else c.num_leaves for c in self.children)


def flatten(
    tree: Any,
    /,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    paths: list[str] | None = None,
    root: str = "",
) -> tuple[list[Any], TreeSpec | None]:
    """The leaves of ``tree`` depth first, in order, and its spec (``None``: a single leaf).

    Pass a list as ``paths`` to have it filled with each leaf's path (``root['boxes'][0]``).
    ``is_leaf`` stops the walk at the values it accepts.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle; it names the
            path when ``paths`` is given.

    >>> out, spec = flatten({"x": [1, 2], "y": (3,)})
    >>> out, unflatten(spec, [10, 20, 30])
    ([1, 2, 3], {'x': [10, 20], 'y': (30,)})
    """
    out: list[Any] = []
    spec = _flatten(tree, out, is_leaf, paths, root, 0)
    return out, spec


def _flatten(
    obj: Any,
    out: list[Any],
    is_leaf: Callable[[Any], bool] | None,
    paths: list[str] | None,
    path: str,
    depth: int,
) -> TreeSpec | None:
    kind = _WALKED.get(kind_of(obj))
    if kind is None or (is_leaf is not None and is_leaf(obj)):
        out.append(obj)
        if paths is not None:
            paths.append(path)
        return None
    if depth > MAX_DEPTH:
        raise TooDeep(path if paths is not None else None)
    keys, values = struct_items(obj, kind)
    if paths is None:
        children = [_flatten(v, out, is_leaf, None, path, depth + 1) for v in values]
    else:
        children = [
            _flatten(v, out, is_leaf, paths, path + path_key(kind, k), depth + 1)
            for k, v in zip(keys, values, strict=True)
        ]
    return TreeSpec(kind, obj, keys, children)


def unflatten(spec: TreeSpec | None, leaves: Iterable[Any], /) -> Any:
    """The tree of ``spec`` holding ``leaves`` in order, every container of its own type."""
    it = iter(leaves)
    if spec is None:
        return next(it)
    return _unflatten(spec, it)


def _unflatten(spec: TreeSpec, it: Iterator[Any]) -> Any:
    values = [next(it) if c is None else _unflatten(c, it) for c in spec.children]
    return rebuild(spec.kind, spec.template, spec.keys, values)


def leaves(
    tree: Any, /, *, is_leaf: Callable[[Any], bool] | None = None, _depth: int = 0
) -> Iterator[Any]:
    """The leaves of ``tree``, depth first, lazily (a search stops at the first match).

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    kind = _WALKED.get(kind_of(tree))
    if kind is None or (is_leaf is not None and is_leaf(tree)):
        yield tree
        return
    if _depth > MAX_DEPTH:
        raise TooDeep
    for value in struct_items(tree, kind)[1]:
        yield from leaves(value, is_leaf=is_leaf, _depth=_depth + 1)


def map_leaves(
    fn: Callable[[Any], Any],
    tree: Any,
    /,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    _depth: int = 0,
) -> Any:
    """``tree`` with ``fn`` applied to every leaf, every container rebuilt with its own type.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    kind = _WALKED.get(kind_of(tree))
    if kind is None or (is_leaf is not None and is_leaf(tree)):
        return fn(tree)
    if _depth > MAX_DEPTH:
        raise TooDeep
    keys, values = struct_items(tree, kind)
    depth = _depth + 1
    return rebuild(
        kind, tree, keys, [map_leaves(fn, v, is_leaf=is_leaf, _depth=depth) for v in values]
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
    kind = _WALKED.get(kind_of(obj))
    if kind is None:
        return obj
    keys, values = struct_items(obj, kind)
    depth = _depth + 1
    return rebuild(kind, obj, keys, [map_tensors(v, fn, shared_fn, depth) for v in values])


def contains_array(obj: Any, /) -> bool:
    """True when a tensor or ndarray lies anywhere inside ``obj`` (markers looked into).

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    for leaf in leaves(obj):
        if isinstance(leaf, torch.Tensor) or _is_ndarray(leaf):
            return True
        if isinstance(leaf, (Shared, Split)) and contains_array(leaf.obj):
            return True
    return False


def _is_ndarray(obj: Any) -> bool:
    return type(obj) is np.ndarray


# ---------------------------------------------------------------------------- describe


def describe(obj: Any, /, *, nested: bool = False, budget: int = 400) -> str:
    """A short description of a value for plans and messages.

    By default one line about the value itself: ``Tensor[10, 3] float32``, ``list[4] of
    Tensor``, ``dict with 2 keys``. ``nested=True`` draws the whole structure instead, types,
    keys and shapes (``{'x': Tensor(2, 3):float32}``), cut at ``budget`` characters: the
    picture an error shows of each replica's or rank's output.
    """
    if nested:
        text = _picture(obj)
        return text if len(text) <= budget else text[: budget - 3] + "..."
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
        # the item types found at C speed (a per-sample list may hold thousands of items)
        kinds = sorted(
            {"Tensor" if issubclass(t, torch.Tensor) else t.__name__ for t in set(map(type, obj))}
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


def _picture(obj: Any, depth: int = 0) -> str:
    kind = kind_of(obj)
    if depth > MAX_DEPTH:
        return "..."
    if kind == TENSOR:
        return f"Tensor{tuple(obj.shape)}:{str(obj.dtype).removeprefix('torch.')}"
    if kind == ARRAY:
        return f"ndarray{obj.shape}:{obj.dtype}"
    if kind in (MAPPING, RECORD):
        inner = ", ".join(f"{k!r}: {_picture(v, depth + 1)}" for k, v in obj.items())
        return f"{{{inner}}}" if type(obj) is dict else f"{type(obj).__name__}({{{inner}}})"
    if kind == DATACLASS:
        names = fields_of(type(obj))
        inner = ", ".join(f"{n}={_picture(getattr(obj, n), depth + 1)}" for n in names)
        return f"{type(obj).__name__}({inner})"
    if kind in _SEQUENCES:
        items = [_picture(v, depth + 1) for v in obj[:6]]
        if len(obj) > 6:
            items.append(f"... {len(obj)} items")
        return f"{type(obj).__name__}[{', '.join(items)}]"
    return type(obj).__name__
