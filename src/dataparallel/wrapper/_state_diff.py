"""``check=``'s comparison of the module tree's plain state with the copy's on one device.

A forward can write state that is neither a parameter nor a buffer: a count (``self.calls +=
1``), a list it appends to, a numpy array it writes in place (``self.hist[y] += 1``), a tensor
kept as a plain attribute. Parameters and buffers carry version counters and the replicas'
copies are watched (``replicate``); a numpy array or a Python number has nothing to watch, so
a write the replicas make once each (a numpy array they share) or from replica 0's chunk only
(a count) cannot be seen at the call. ``check=`` has the one-device result at hand: after a
checked call, each module's plain attributes are compared with the copy's, and each one that
differs is named with the first place inside it that does (``attribute hist[3]: 6 where one
device has 3``).

Compared: numbers (floats relative to their magnitude), strings, bytes, ``None``, numpy arrays
and scalars, and lists, tuples, deques, dicts and sets of these, down to four levels. A dict
keyed by objects (the tree's modules, tensors) is compared by the order of its entries and a
set of them not at all: the copy holds copies of them, equal to none of the module's. Not
compared: other objects (an iterator, a generator, a config object: nothing to compare them
by), and tensors kept as plain attributes. A tensor a forward keeps of its batch (a capture of
the last activations, a target of the batch's shape made once and reused: pix2pixHD's GAN
loss) holds replica 0's chunk by the guide's rule, and would be reported on every program that
keeps one; parameters and buffers are compared by ``_one_device``. The cost is paid on checked
calls only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["state_differences"]

# nn.Module's own attributes (the tables, the training flag, the hook dicts): not the user's.
_INTERNAL = frozenset(nn.Module().__dict__)
_EXACT = (bool, str, bytes, type(None))
_SEQUENCES = (list, tuple, deque)
_DEPTH = 4
_RTOL = 1e-4
_FLOOR = 1e-3
_MISSING = object()


def state_differences(module: nn.Module, copy_: nn.Module) -> Iterator[tuple[str, str]]:
    """``(place, words)`` for each plain attribute of ``module``'s tree whose value differs
    from the one-device copy's."""
    theirs = dict(copy_.named_modules())
    for name, mine in module.named_modules():
        other = theirs.get(name)
        if other is None:
            continue
        copied = other.__dict__
        for key, value in mine.__dict__.items():
            if key in _INTERNAL or key.startswith("_dataparallel"):
                continue
            found = _difference(value, copied.get(key, _MISSING), 0)
            if found is not None:
                inside, words = found
                yield f"attribute {name + '.' if name else ''}{key}{inside}", words


def _difference(a: Any, b: Any, depth: int) -> tuple[str, str] | None:
    """``(the path inside, words)`` of the first place where ``a`` differs from ``b``, or
    ``None`` (also for what is not compared)."""
    if a is b or b is _MISSING or depth > _DEPTH:
        return None
    if isinstance(a, np.generic):
        a = a.item()
    if isinstance(b, np.generic):
        b = b.item()
    if isinstance(a, _EXACT) or isinstance(b, _EXACT):
        # (``None`` where one device has an array: no ``==`` between them, which would give
        # an array)
        same = type(a) is type(b) and _equal(a, b)
        return None if same else ("", f"{_short(a)} where one device has {_short(b)}")
    if _number(a) and _number(b):
        return None if _close(a, b) else ("", f"{_short(a)} where one device has {_short(b)}")
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return None
    if isinstance(a, np.ndarray):
        return _arrays(a, b)
    if isinstance(a, _SEQUENCES):
        if len(a) != len(b):
            return "", f"{len(a)} items where one device has {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _difference(x, y, depth + 1)
            if found is not None:
                return f"[{i}]{found[0]}", found[1]
        return None
    if isinstance(a, dict):
        if len(a) != len(b):
            return "", f"{len(a)} entries where one device has {len(b)}"
        if all(map(_atom, a)) and all(map(_atom, b)):
            if a.keys() != b.keys():
                here = [k for k in a if k not in b][:4]
                there = [k for k in b if k not in a][:4]
                return "", f"keys only here: {here}; only on one device: {there}"
            items = [(k, x, b[k]) for k, x in a.items()]
        else:
            # Keys that are objects (the tree's modules, tensors): the copy's are copies of
            # them, equal to none of ours, so the entries are paired by their order.
            items = [(k, x, y) for (k, x), y in zip(a.items(), b.values(), strict=True)]
        for k, x, y in items:
            found = _difference(x, y, depth + 1)
            if found is not None:
                key = _short(k) if _atom(k) else f"<{type(k).__name__}>"
                return f"[{key}]{found[0]}", found[1]
        return None
    if isinstance(a, (set, frozenset)) and all(map(_atom, a)) and all(map(_atom, b)):
        # (a set of objects is not compared: the copy's are copies, equal to none of ours)
        if a == b:
            return None
        return "", f"{len(a)} items where one device has {len(b)} (or others)"
    return None


def _arrays(a: np.ndarray, b: np.ndarray) -> tuple[str, str] | None:
    if a.shape != b.shape:
        return "", f"shape {a.shape} where one device has {b.shape}"
    if a.dtype.kind in "fc" and b.dtype.kind in "fc":
        # (equal arrays, the usual, cost one pass and no copy)
        if a.size == 0 or np.array_equal(a, b, equal_nan=True):
            return None
        with np.errstate(invalid="ignore", over="ignore"):  # (inf - inf, float16 overflow)
            same = (a == b) | (np.isnan(a) & np.isnan(b))  # (an infinity equals itself)
            diff = np.where(same, 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf))
        magnitude = np.abs(np.nan_to_num(a)).max(), np.abs(np.nan_to_num(b)).max()
        scale = max(float(magnitude[0]), float(magnitude[1]), _FLOOR)
        at = np.unravel_index(int(np.argmax(diff)), diff.shape)
        if float(diff[at]) <= _RTOL * scale:
            return None
        return _at(a, b, at)
    try:
        unequal = np.asarray(a != b, dtype=bool)
    except Exception:  # object arrays whose items cannot be compared
        return None
    if unequal.shape != a.shape or not unequal.any():
        return None
    return _at(a, b, np.unravel_index(int(np.argmax(unequal)), a.shape))


def _at(a: np.ndarray, b: np.ndarray, at: tuple[Any, ...]) -> tuple[str, str]:
    """The place ``at`` in two arrays, and their values there."""
    where = f"[{', '.join(str(int(i)) for i in at)}]" if at else ""
    return where, f"{_short(a[at].item())} where one device has {_short(b[at].item())}"


def _atom(x: Any) -> bool:
    """Whether ``x`` is a value compared by ``==`` as a key or a set's item (a number, a
    string, ``None``, or a tuple of these), not an object that the copy holds a copy of."""
    return isinstance(x, (*_EXACT, int, float, complex)) or (
        type(x) is tuple and all(map(_atom, x))
    )


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # (an ``__eq__`` of a subclass that does not give a truth value)
        return False


def _number(x: Any) -> bool:
    return isinstance(x, (int, float, complex))


def _close(a: complex, b: complex) -> bool:
    """Equal integers; floats within ``_RTOL`` of the larger magnitude (NaN equals NaN)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if a == b:
        return True
    nan_a = isinstance(a, float) and math.isnan(a)
    nan_b = isinstance(b, float) and math.isnan(b)
    if nan_a or nan_b:
        return nan_a and nan_b
    return abs(a - b) <= _RTOL * max(abs(a), abs(b), _FLOOR)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:57]}..."
