"""Gather's own helpers: paths for messages, moving one output, equality and sums.

The kinds of values and the rebuild functions are :mod:`dataparallel._common.kinds`' and
:mod:`dataparallel._common.rebuild`'s, shared with the batch rules. What is gather's alone
lives here: the chain of keys that names an output (``output['attn']``), formatted only when a
message needs it; :func:`to_target`, which moves a single replica's output to the target device,
reusing every container whose contents did not move; :func:`rebuild_at`, a rebuild whose error
names the output path; and the equality checks and sums of the guide's "The gather rules, in
short".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.overrides import get_default_nowrap_functions

from dataparallel._common.kinds import (
    ATOMS,
    DATACLASS,
    LIST,
    MAPPING,
    NAMEDTUPLE,
    RECORD,
    TENSOR,
    TUPLE,
    fields_of,
    kind_of,
)
from dataparallel._common.packed import is_packed
from dataparallel._common.rebuild import rebuild_mapping, rebuild_record, rebuild_sequence

__all__ = [
    "ATOMS",
    "ESCAPES",
    "Mark",
    "Path",
    "all_equal",
    "arrays_equal",
    "fmt",
    "fmt_attributes",
    "move",
    "rebuild_at",
    "retype",
    "sum_all",
    "to_target",
]

# A path is a chain of (parent, accessor, key) tuples, None at the root; it is formatted only
# for a message, so the walk pays nothing for it.
Path = Any

# Exact types that hold no tensor and never move: per-sample lists of them (names, ids) are
# checked and concatenated at C speed. Subclasses take the full walk.


# Accessors in a path: "[" an item (a list or tuple index, a Mapping key), "." a field (a
# namedtuple's, a dataclass's), FIELD a model-output class's field (a Mapping that is also a
# dataclass, such as transformers' ``SequenceClassifierOutput``). Its users write both
# ``out["logits"]`` and ``out.logits``: the messages print the first (the model outputs' own
# ``keys()`` are what is walked), and ``output_rules`` accepts either (``fmt_attributes``).
FIELD = "@"


def fmt(path: Path) -> str:
    """The path as the messages print it: ``output['attn'][0]``, ``output.hidden[1]``; a
    model-output class's field as a key, ``output['logits']``."""
    parts: list[str] = []
    while path is not None:
        path, accessor, key = path
        parts.append(f".{key}" if accessor == "." else f"[{key!r}]")
    return "output" + "".join(reversed(parts))


def fmt_attributes(path: Path) -> str | None:
    """The path with each model-output field spelled as an attribute (``output.logits``), the
    other spelling ``output_rules`` accepts; ``None`` when the path has no such field."""
    parts: list[str] = []
    found = False
    while path is not None:
        path, accessor, key = path
        if accessor == FIELD and isinstance(key, str) and key.isidentifier():
            found = True
            parts.append(f".{key}")
        else:
            parts.append(f".{key}" if accessor == "." else f"[{key!r}]")
    return "output" + "".join(reversed(parts)) if found else None


class Mark(torch.Tensor):
    """What every mark shares (``_loss._marks``: the data, the loss terms, the count): a torch
    op on a marked tensor runs on plain tensors, and ``_follow`` marks its result from the
    marks of its arguments; the user passed plain tensors, and gets plain ones back."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return out if func in _NOWRAP else cls._follow(func, args, kwargs, out)

    @classmethod
    def _follow(cls, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        """``func``'s result marked as its arguments' marks say (each kind of mark's rule)."""
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        return repr(retype(self, torch.Tensor))


# torch's own: getters whose results are never converted to the subclass (``.grad``, ``._base``)
_NOWRAP = get_default_nowrap_functions()
_T = torch.Tensor
# Ways a marked tensor becomes a plain Python number, whose later uses cannot be followed.
ESCAPES = frozenset({_T.item, _T.tolist, _T.__float__, _T.__int__, _T.__complex__, _T.numpy})


def retype(value: Any, cls: type) -> Any:
    """A tensor ``value`` as a ``cls`` (a mark, or ``torch.Tensor`` for none), sharing its
    data and graph; anything else as it is."""
    if isinstance(value, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return value.as_subclass(cls)
    return value


def move(t: torch.Tensor, target: torch.device) -> torch.Tensor:
    """``t`` on ``target``: itself where it is there already, else moved by torch's own
    ``Tensor.to``, never a subclass's Python ``to`` (BigGAN's ``Distribution.to`` reads
    attributes its slices lack), as ``torch._C._gather`` moves it. A marked chunk's data
    passed through (``Mark``) comes back plain."""
    if isinstance(t, Mark):
        t = retype(t, torch.Tensor)
    return t if t.device == target else _TO(t, target)


_TO = torch.Tensor.to


def to_target(obj: Any, target: torch.device, path: Path) -> Any:
    """``obj`` with every tensor in it moved to ``target``; unchanged containers are reused."""
    kind = kind_of(obj)
    if kind == TENSOR:
        return move(obj, target)
    if kind == NAMEDTUPLE and is_packed(obj):
        return obj.to(target)  # keeps batch_sizes on the CPU, as torch requires
    if kind in (LIST, TUPLE, NAMEDTUPLE):
        items = [to_target(item, target, path) for item in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return rebuild_at(path, rebuild_sequence, obj, items)
    if kind in (MAPPING, RECORD):
        data = {k: to_target(v, target, path) for k, v in obj.items()}
        names = [n for n in fields_of(type(obj)) if n not in data] if kind == RECORD else []
        extra = [(n, to_target(getattr(obj, n), target, path)) for n in names]
        if all(v is obj[k] for k, v in data.items()) and all(
            v is getattr(obj, n) for n, v in extra
        ):
            return obj
        if kind == RECORD:
            return rebuild_at(path, rebuild_record, obj, extra, data)
        return rebuild_at(path, rebuild_mapping, obj, data)
    if kind == DATACLASS:
        fields = [(n, getattr(obj, n)) for n in fields_of(type(obj))]
        moved = [(n, to_target(v, target, path)) for n, v in fields]
        if all(a[1] is b[1] for a, b in zip(fields, moved, strict=True)):
            return obj
        return rebuild_at(path, rebuild_record, obj, moved)
    return obj


def rebuild_at(path: Path, build: Callable[..., Any], first: Any, *args: Any) -> Any:
    """``build(first, *args)``, one of ``_common.rebuild``'s functions, with an error that names
    the output path when the class refuses its gathered items."""
    try:
        return build(first, *args)
    except Exception as exc:
        raise TypeError(
            f"{fmt(path)}: cannot rebuild a {type(first).__name__} from the gathered items "
            f"({exc}); expected a class that accepts its items like its base class does. "
            f"Return a plain list, tuple or dict, or use gather=False"
        ) from exc


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
