"""What kind of value a replica's output is, and how to move or rebuild one: gather's vocabulary.

``gather`` dispatches once per value on its class: :func:`kind_of` classifies a class once and
caches it. The rebuild helpers make a container of the gathered items with the type of the
first replica's container (namedtuples, list and dict subclasses, dataclasses, model-output
classes), and :func:`to_target` moves a single replica's output to the target device,
reusing every container whose contents did not move.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dataparallel._packed import is_packed
from dataparallel._tree import rebuild_mapping, rebuild_sequence

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
    "STRUCTURES",
    "TENSOR",
    "TUPLE",
    "Path",
    "all_equal",
    "arrays_equal",
    "cannot_rebuild",
    "fields_of",
    "fmt",
    "kind_of",
    "rebuild_dataclass",
    "rebuild_mapping_like",
    "rebuild_seq",
    "sum_all",
    "to_target",
]

# A path is a chain of (parent, accessor, key) tuples, None at the root; it is formatted only
# for a message, so the walk pays nothing for it.
Path = Any

# Kinds of values: a class is classified once, then found with one dict lookup.
NONE, TENSOR, ARRAY, BOOL, NUMBER, LIST, TUPLE, NAMEDTUPLE = range(8)
MAPPING, DATACLASS, RECORD, OTHER = range(8, 12)
STRUCTURES = frozenset((LIST, TUPLE, NAMEDTUPLE, MAPPING, DATACLASS, RECORD))
# Exact types that hold no tensor and never move: per-sample lists of them (names, ids) are
# checked and concatenated at C speed. Subclasses take the full walk.
ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})
_KINDS: dict[type, int] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
_MAX_CACHED = 4096  # classes made on the fly (a namedtuple per call) must not grow it forever


def classify(cls: type) -> int:
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
        return OTHER
    if issubclass(cls, list):
        return LIST
    if issubclass(cls, tuple):
        return NAMEDTUPLE if hasattr(cls, "_fields") else TUPLE
    is_dataclass = dataclasses.is_dataclass(cls)
    if issubclass(cls, Mapping):
        return RECORD if is_dataclass else MAPPING
    return DATACLASS if is_dataclass else OTHER


def kind_of(obj: Any) -> int:
    cls = type(obj)
    kind = _KINDS.get(cls)
    if kind is None:
        if len(_KINDS) >= _MAX_CACHED:
            _KINDS.clear()
        kind = _KINDS[cls] = classify(cls)
    return kind


def fields_of(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        if len(_FIELDS) >= _MAX_CACHED:
            _FIELDS.clear()
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def fmt(path: Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, accessor, key = path
        parts.append(f".{key}" if accessor == "." else f"[{key!r}]")
    return "output" + "".join(reversed(parts))


def to_target(obj: Any, target: torch.device, path: Path) -> Any:
    """``obj`` with every tensor in it moved to ``target``; unchanged containers are reused."""
    kind = kind_of(obj)
    if kind == TENSOR:
        return obj.to(target)
    if kind == NAMEDTUPLE and is_packed(obj):
        return obj.to(target)  # keeps batch_sizes on the CPU, as torch requires
    if kind in (LIST, TUPLE, NAMEDTUPLE):
        items = [to_target(item, target, path) for item in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return rebuild_seq(obj, items, path)
    if kind in (MAPPING, RECORD):
        data = {k: to_target(v, target, path) for k, v in obj.items()}
        names = [n for n in fields_of(type(obj)) if n not in data] if kind == RECORD else []
        extra = [(n, to_target(getattr(obj, n), target, path)) for n in names]
        if all(v is obj[k] for k, v in data.items()) and all(
            v is getattr(obj, n) for n, v in extra
        ):
            return obj
        if kind == RECORD:
            return rebuild_dataclass(obj, extra, data, path)
        return rebuild_mapping_like(obj, data, path)
    if kind == DATACLASS:
        fields = [(n, getattr(obj, n)) for n in fields_of(type(obj))]
        moved = [(n, to_target(v, target, path)) for n, v in fields]
        if all(a[1] is b[1] for a, b in zip(fields, moved, strict=True)):
            return obj
        return rebuild_dataclass(obj, moved)
    return obj


def cannot_rebuild(first: Any, path: Path, exc: Exception) -> TypeError:
    return TypeError(
        f"{fmt(path)}: cannot rebuild a {type(first).__name__} from the gathered items "
        f"({exc}); expected a class that accepts its items like its base class does. Return a "
        f"plain list, tuple or dict, or use gather=False"
    )


def rebuild_seq(first: Any, items: list[Any], path: Path) -> Any:
    cls = type(first)
    if cls is list or cls is tuple:
        return items if cls is list else tuple(items)
    try:  # a namedtuple takes its fields positionally; other subclasses keep their attributes
        if hasattr(cls, "_fields"):
            try:
                return cls(*items)
            except TypeError:  # its own __new__: built as _make does
                pass
        return rebuild_sequence(first, items)
    except Exception as exc:
        raise cannot_rebuild(first, path, exc) from exc


def rebuild_mapping_like(first: Mapping[Any, Any], data: dict[Any, Any], path: Path) -> Any:
    if type(first) is dict:
        return data
    try:
        return rebuild_mapping(first, data)
    except Exception as exc:
        raise cannot_rebuild(first, path, exc) from exc


def rebuild_dataclass(
    first: Any,
    fields: list[tuple[str, Any]],
    items: dict[Any, Any] | None = None,
    path: Path = None,
) -> Any:
    """A copy of ``first`` with new fields (and, for a model-output class, new items).

    copy.copy skips __init__ (init=False fields, __post_init__); object.__setattr__ passes
    frozen dataclasses.
    """
    out = copy.copy(first)
    for name, value in fields:
        object.__setattr__(out, name, value)
    if items:
        names = fields_of(type(first))
        try:
            for key, value in items.items():
                if key in names:
                    object.__setattr__(out, key, value)
                if isinstance(out, dict):
                    dict.__setitem__(out, key, value)  # past overrides such as ModelOutput's
                else:
                    out[key] = value
        except Exception as exc:
            raise cannot_rebuild(first, path, exc) from exc
    return out


def arrays_equal(values: list[Any]) -> bool:
    """Whether tensors or ndarrays are equal on every replica (shape, dtype and values)."""
    first = values[0]
    equal = torch.equal if isinstance(first, torch.Tensor) else np.array_equal
    try:
        return all(
            v is first or (v.shape == first.shape and v.dtype == first.dtype and equal(v, first))
            for v in values
        )
    except Exception:  # object arrays whose items refuse ==
        return False


def all_equal(values: list[Any]) -> bool:
    """``==`` on every replica, guarded: an error or a non-bool answer (arrays) means no."""
    first = values[0]
    for value in values[1:]:
        if value is first:
            continue
        try:
            same = value == first
        except Exception:
            return False
        if not (same is True or (isinstance(same, np.bool_) and bool(same))):
            return False
    return True


def sum_all(items: list[Any]) -> Any:
    """The sum of the replicas' values."""
    return sum(items[1:], items[0])  # starts from the first, so ints stay ints
