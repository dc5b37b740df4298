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

from dataparallel._common.tree import leaves, map_leaves, map_tensors
from dataparallel.markers import Shared, Split

__all__ = ["contains_record", "has_to", "move_item"]

_NEVER = (torch.Tensor, np.ndarray, nn.Module, list, tuple, str, bytes, Shared, Split, type)


def has_to(obj: Any) -> bool:
    """Whether ``obj`` is a record that moves itself with ``.to(device)``.

    Tensors, ndarrays, lists, tuples, markers and modules are excluded: tensors are moved by
    the rules directly, and ``nn.Module.to`` moves a module in place, which no input should
    undergo behind its owner's back.
    """
    return not isinstance(obj, _NEVER) and callable(getattr(type(obj), "to", None))


def contains_record(obj: Any) -> bool:
    """Whether ``obj`` is, or holds in nested containers, a record with ``.to``.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    return any(has_to(leaf) for leaf in leaves(obj, is_leaf=has_to))


def move_item(
    obj: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    shared_fn: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
) -> Any:
    """One per-sample item on ``device``: records by their own ``.to``, tensors by ``fn``.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """

    def move(leaf: Any) -> Any:
        if has_to(leaf):
            return copy.copy(leaf).to(device)
        return map_tensors(leaf, fn, shared_fn)  # a tensor, a marker or a plain leaf

    return map_leaves(move, obj, is_leaf=has_to)
