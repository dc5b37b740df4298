"""Per-sample objects that carry tensors: moved to their replica's device by their own ``.to``.

A list of PyG ``Data`` graphs, of HuggingFace ``BatchEncoding`` records or of your own
classes with a ``.to(device)`` method is split per sample (rule 4); each item is then moved to
its replica's device the way its class says, by calling ``.to(device)``. The call is made on a
shallow copy, because some ``.to`` methods (PyG's, ``BatchEncoding``'s) move in place and
return ``self``: the caller's objects are never changed. Items without ``.to`` are walked as
containers (lists, tuples, dicts, dataclasses), their tensors moved one by one; records found
inside such containers are moved by their own ``.to`` too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from dataparallel._tree import (
    MAX_DEPTH,
    TooDeep,
    container_kind,
    map_tensors,
    rebuild,
    struct_items,
)
from dataparallel.markers import Shared, Split

__all__ = ["has_to", "move_item"]

_NEVER = (torch.Tensor, np.ndarray, nn.Module, list, tuple, str, bytes, Shared, Split, type)


def has_to(obj: Any) -> bool:
    """Whether ``obj`` is a record that moves itself with ``.to(device)``.

    Tensors, ndarrays, lists, tuples, markers and modules are excluded: tensors are moved by
    the rules directly, and ``nn.Module.to`` moves a module in place, which no input should
    undergo behind its owner's back.
    """
    return not isinstance(obj, _NEVER) and callable(getattr(type(obj), "to", None))


def contains_record(obj: Any, _depth: int = 0) -> bool:
    """Whether ``obj`` is, or holds in nested containers, a record with ``.to``.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    if _depth > MAX_DEPTH:
        raise TooDeep
    if has_to(obj):
        return True
    kind = container_kind(obj)
    if kind is None:
        return False
    return any(contains_record(v, _depth + 1) for v in struct_items(obj, kind)[1])


def move_item(
    obj: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    shared_fn: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    _depth: int = 0,
) -> Any:
    """One per-sample item on ``device``: records by their own ``.to``, tensors by ``fn``.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    if _depth > MAX_DEPTH:
        raise TooDeep
    if has_to(obj):
        return copy.copy(obj).to(device)
    kind = container_kind(obj)
    if kind is None:
        return map_tensors(obj, fn, shared_fn)  # a tensor, a marker or a plain leaf
    keys, values = struct_items(obj, kind)
    return rebuild(
        kind, obj, keys, [move_item(v, fn, shared_fn, device, _depth + 1) for v in values]
    )
