"""Text for plans and messages: a short description of a value, or a picture of a tree.

Kept apart from the walks: only messages and ``explain`` read it, and its pictures stop at
``MAX_DEPTH`` instead of refusing a tree nested too deep.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dataparallel._common.kinds import (
    ARRAY,
    DATACLASS,
    MAPPING,
    RECORD,
    SEQUENCES,
    TENSOR,
    fields_of,
    kind_of,
)
from dataparallel._common.tree import MAX_DEPTH
from dataparallel.markers import Shared, Split

__all__ = ["describe"]


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
    if type(obj) is np.ndarray:
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
    if kind in SEQUENCES:
        items = [_picture(v, depth + 1) for v in obj[:6]]
        if len(obj) > 6:
            items.append(f"... {len(obj)} items")
        return f"{type(obj).__name__}[{', '.join(items)}]"
    return type(obj).__name__
