"""Where a call passes ``num_items_in_batch`` (by keyword or by position), if it does.

transformers' ``Trainer`` passes the labelled-token count of the whole batch to every model
whose ``forward`` takes ``**kwargs``. Each replica receives it whole and marked
(``gather.mark_inputs``), and gather places what forward computed from it (``gather._loss``);
one chunk (every one-device call) passes it as it is.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Mapping
from typing import Any

from torch import nn

from dataparallel.gather import COUNT_KEYWORD

__all__ = [
    "COUNT_KEYWORD",
    "DEFAULT_SCALARS",
    "count_position",
    "find_count",
    "param_position",
]

# ``scalars``' default. (A wrapper pickled before issue 39 held a ``_DefaultScalars`` string
# that pickles as this name: kept, so those load.)
DEFAULT_SCALARS = "mean"

# (id of a forward function, a parameter name) -> (a weak reference to the function, the
# position of that name among its positional parameters or -1): weak, so a forward function
# (and what its closure holds) is never kept alive by this table; keyed by id, so a lookup
# makes no weak reference (a WeakKeyDictionary makes one per call). An id reused by a new
# function fails the identity check.
_POSITIONS: dict[tuple[int, str], tuple[weakref.ref[Any], int]] = {}
_MAX_POSITIONS = 4096


def param_position(module: nn.Module, name: str) -> int | None:
    """Where ``module``'s ``forward`` takes the parameter ``name`` by position, if it does.

    Read once per forward function and name: only calls with positional arguments ask.

    >>> class Net(nn.Module):
    ...     def forward(self, ids, labels, num_items_in_batch=None):
    ...         return ids
    >>> param_position(Net(), "labels"), param_position(nn.Linear(1, 1), "labels")
    (1, None)
    """
    forward = module.forward
    key = getattr(forward, "__func__", forward)
    kept = _POSITIONS.get((id(key), name))
    found = kept[1] if kept is not None and kept[0]() is key else None
    if found is None:
        found = -1
        try:
            params = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):  # no signature to read: the value is a keyword
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for i, p in enumerate(positional):
            if p.name == name:
                found = i
        if len(_POSITIONS) >= _MAX_POSITIONS:
            _POSITIONS.clear()
        with contextlib.suppress(TypeError):  # a callable that takes no weak reference
            _POSITIONS[(id(key), name)] = (weakref.ref(key), found)
    return None if found < 0 else found


def count_position(module: nn.Module) -> int | None:
    """Where ``module``'s ``forward`` takes ``num_items_in_batch`` by position, if it does.

    >>> class Net(nn.Module):
    ...     def forward(self, ids, labels, num_items_in_batch=None):
    ...         return ids
    >>> count_position(Net()), count_position(nn.Linear(1, 1))
    (2, None)
    """
    return param_position(module, COUNT_KEYWORD)


def find_count(
    module: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str | int | None:
    """Where this call passes the count (its keyword, or its position), ``None`` where it
    passes none (or ``None``)."""
    if COUNT_KEYWORD in kwargs:
        return None if kwargs[COUNT_KEYWORD] is None else COUNT_KEYWORD
    if not inputs:
        return None
    index = count_position(module)
    if index is None or index >= len(inputs) or inputs[index] is None:
        return None
    return index
