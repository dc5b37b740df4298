"""The wrapper's side of the marks: each chunk's inputs marked as its replica receives them.

A call that passes an integer tensor (labels, ids: what a loss in forward needs) has each
chunk's tensors marked ``Target``; a call of floats alone (an image batch) is left as it is, at
no cost. A call that passes ``num_items_in_batch`` on several chunks hands each replica the
whole count, marked with the call's ``Record`` (``_marks``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataparallel.gather._loss._marks import Record, Target, is_counted, is_marked, unmark
from dataparallel.gather._outputs import retype

__all__ = ["leaves", "mark_inputs", "marks_plain", "passes_integers", "unmark_inputs"]


def _mark(value: Any) -> Any:
    return retype(value, Target) if type(value) is torch.Tensor and value.ndim else value


def leaves(chunk_args: Any, chunk_kwargs: Any) -> Any:
    """A chunk's arguments, at the top and one plain list, tuple or dict down."""
    for value in (*(chunk_args or ()), *(chunk_kwargs or {}).values()):
        kind = type(value)
        if kind is list or kind is tuple:
            for v in value:
                yield from v.values() if type(v) is dict else (v,)
        else:
            yield from value.values() if kind is dict else (value,)


def passes_integers(chunk_args: Any, chunk_kwargs: Any) -> bool:
    """Whether a call passes an integer tensor (labels, ids), which makes it mark its data."""
    return any(map(_integers, leaves(chunk_args, chunk_kwargs)))


def marks_plain(inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """``mark_inputs``' decision for a call of plain tensors only (the warm call's), read from
    the call's own tensors: each chunk's are their parts, of the same dtype and dimensions.
    (``_integers``, inline: every value here is a plain tensor.)"""
    for t in inputs:
        if t.dtype not in _NO_TARGET and t.ndim:
            return True
    if kwargs:
        for t in kwargs.values():
            if t.dtype not in _NO_TARGET and t.ndim:
                return True
    return False


def _integers(value: Any) -> bool:
    return type(value) is torch.Tensor and value.ndim > 0 and value.dtype not in _NO_TARGET


_NO_TARGET = frozenset(  # tensors that alone do not make a call mark its chunks
    {torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64}
)


def mark_inputs(
    args: Sequence[Any],
    kwargs: Sequence[Any],
    targets: bool = True,
    count: Record | None = None,
    slot: str | int | None = None,
) -> tuple[list[Any], list[Any]]:
    """Each chunk's inputs marked, in one pass: with ``targets``, its tensors (at the top, or
    one plain container down: DETR's list of per-image dicts) where the call passes an integer
    tensor; with ``count``, its copy of ``num_items_in_batch`` (at ``slot``, a keyword or a
    position) with the call's mark. The containers are copies: a chunk's may be the caller's
    own."""
    targets = targets and bool(args) and passes_integers(args[0], kwargs[0])
    if not targets and count is None:
        return list(args), list(kwargs)

    def one(key: Any, value: Any) -> Any:
        if count is not None and key == slot and value is not None:
            return count.mark(value)
        kind = type(value)  # exactly these: a container of the user's class stays as it is
        if not targets:
            return value
        if kind is list or kind is tuple:
            return kind(_dict(v) if type(v) is dict else _mark(v) for v in value)
        return _dict(value) if kind is dict else _mark(value)

    def _dict(d: Mapping[Any, Any]) -> Any:
        return {k: _mark(v) for k, v in d.items()}

    new_args = [tuple(one(*iv) for iv in enumerate(a)) if isinstance(a, tuple) else a for a in args]
    new_kws = [{k: one(k, v) for k, v in kw.items()} if kw else kw for kw in kwargs]
    return new_args, new_kws


def unmark_inputs(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A wrapper's call inside another's replica: its arguments plain (it marks its own)."""
    if not kwargs and len(inputs) == 1 and type(inputs[0]) is torch.Tensor:
        return inputs, kwargs  # the most common call: one plain tensor, which is not marked
    if any(map(is_marked, inputs)) or any(map(is_marked, kwargs.values())):
        return tuple(map(_strip, inputs)), {k: _strip(v) for k, v in kwargs.items()}
    return inputs, kwargs


def _strip(value: Any) -> Any:
    # the outer call's count stays marked: what the inner computes from it is the outer's part
    return value if is_counted(value) else unmark(value)
