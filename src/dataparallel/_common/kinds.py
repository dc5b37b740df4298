"""The kinds of values: one vocabulary of container kinds for inputs and outputs.

Plan, scatter, gather and the distributed helpers all walk the same containers: tuples,
namedtuples, lists, Mappings (dicts, OrderedDicts, ``MappingProxyType``, model-output classes)
and dataclasses. This module is the one place that classifies a value (:func:`kind_of`, one
dict lookup per class), lists a container's children in order (:func:`struct_items`: dict order
as given, never sorted) and names their paths (:func:`path_key`: ``args[1]['boxes']``,
``output.hidden[0]``). Rebuilding a container is :mod:`dataparallel._common.rebuild`'s job, walking
a whole tree :mod:`dataparallel._common.tree`'s.

The kinds are strings, the same for inputs and outputs. :func:`kind_of` gives the full kind
(gather dispatches on it); :func:`container_kind` gives the kind a walker sees (``WALKED``), or
``None`` for a leaf: a model-output class (``RECORD``, a Mapping that is also a dataclass) is
walked by key as a ``MAPPING``, as its users index it, and a ``torch.Size`` (``SHAPE``) as a
``TUPLE``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "ARRAY",
    "ATOMS",
    "BOOL",
    "DATACLASS",
    "LIST",
    "MAPPING",
    "NAMEDTUPLE",
    "NONE",
    "NUMBER",
    "OTHER",
    "RECORD",
    "SEQUENCES",
    "SHAPE",
    "STRUCTURES",
    "TENSOR",
    "TUPLE",
    "WALKED",
    "Kind",
    "container_kind",
    "fields_of",
    "item_types",
    "kind_of",
    "path_key",
    "struct_items",
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
WALKED: dict[Kind, Kind] = {
    LIST: LIST,
    TUPLE: TUPLE,
    NAMEDTUPLE: NAMEDTUPLE,
    SHAPE: TUPLE,
    MAPPING: MAPPING,
    RECORD: MAPPING,
    DATACLASS: DATACLASS,
}
# The kinds rebuilt as sequences: lists, tuples, namedtuples and torch.Size.
SEQUENCES = frozenset((LIST, TUPLE, NAMEDTUPLE, SHAPE))

_KINDS: dict[type, Kind] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
_MAX_CACHED = 4096  # classes made on the fly (a namedtuple per call) must not grow it forever


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
    return WALKED.get(kind_of(obj))


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
    """The path suffix of one child: ``[0]``, ``['boxes']`` (a Mapping's key, a model-output
    class's field too) or ``.field`` (a dataclass's, a namedtuple's)."""
    if kind in (DATACLASS, NAMEDTUPLE):
        return f".{key}"
    return f"[{key!r}]"
