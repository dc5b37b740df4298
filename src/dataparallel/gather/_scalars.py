"""Gather rule 2, scalars: numbers, numpy numbers, 0-dim tensors and ndarrays.

Floating scalars are averaged (how a loss is weighed is ``_loss._rule``'s), summed, or
stacked, as ``scalars`` says; booleans come back once if equal, else are refused (naming
``output_rules``' ``"all"`` and ``"any"``); a value each replica received rather than computed
(a buffer, an input) comes back once; integers tell counts
(summed) from constants (kept), as the guide's "The gather rules, in short" say. ``gather``
dispatches here.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from dataparallel.gather._loss import mean_of, refuse_escaped, say
from dataparallel.gather._output_rules import warn_even_count
from dataparallel.gather._outputs import all_equal, fmt, move, sum_all

__all__ = ["gather_scalars"]

# ``gather``'s context (target, scalars, sizes, counts, weights) and output path.
_Ctx = Any
_Path = Any


def gather_scalars(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rule 2: numbers, numpy numbers, 0-dim tensors and ndarrays; booleans apart."""
    target = ctx.target
    if all(_is_bool(v) for v in values):  # never averaged, summed or stacked
        moved = [move(v, target) if isinstance(v, torch.Tensor) else v for v in values]
        if all(bool(v) == bool(moved[0]) for v in moved):
            return moved[0]
        raise _booleans_differ(values, path)
    if ctx.count is not None:
        refuse_escaped(values, path, ctx)  # (_loss._rule's rule 5; mean_of is its 6)
    if ctx.scalars == "stack":
        say(ctx, path, "stacked, one value per replica (scalars='stack')")
        return torch.stack([torch.as_tensor(v, device=target) for v in values])
    sizes = ctx.sizes
    if sizes is not None and len(values) > 1 and all(n == 1 for n in sizes):
        _check_squeezed(values, path, ctx)
    if any(isinstance(v, torch.Tensor) for v in values):
        # as_tensor moves a tensor like .to (differentiably) and makes one of a number
        tensors = [torch.as_tensor(v, device=target) for v in values]
        counts = not any(t.is_floating_point() or t.is_complex() for t in tensors)
        if (counts or ctx.scalars == "sum") and _one_value(values, ctx):
            return tensors[0]  # a buffer or an input passed through: one value, not a count
        if ctx.scalars == "sum" or counts:
            say(ctx, path, "summed (a count)" if counts else "summed (scalars='sum')")
            # An integer tensor is computed from the chunk ((x > 0).sum(), a count of correct
            # predictions): a count, summed even where the replicas agree, as one device's.
            return sum_all(tensors)
        return mean_of(tensors, path, ctx)
    plain = [v[()] if isinstance(v, np.ndarray) else v for v in values]
    if ctx.scalars == "sum":
        say(ctx, path, "summed (scalars='sum')")
        return sum_all(plain)
    if all(isinstance(v, numbers.Integral) for v in plain):
        return _gather_ints(values, plain, path, ctx)
    if all_equal(plain):
        return values[0]  # a constant keeps its type
    return mean_of(plain, path, ctx)


def _gather_ints(values: list[Any], plain: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Python and numpy integers under ``"mean"``: each replica's chunk size is a count of
    samples (``int(x.shape[0])``), summed; integers equal on every replica otherwise are a
    constant (``num_classes``), kept with their type; integers that differ are counts, summed.
    On an even split a constant equal to the chunk size looks like a count: summed, with a
    warning naming ``output_rules``."""
    sizes = ctx.sizes
    if sizes is not None and all(v == n for v, n in zip(plain, sizes, strict=True)):
        total = sum_all(plain)
        if len(set(sizes)) == 1:
            warn_even_count(fmt(path), values[0], sizes[0], total)
        return total
    if all_equal(plain):
        return values[0]
    return sum_all(plain)


def _check_squeezed(values: list[Any], path: _Path, ctx: _Ctx) -> None:
    """Every chunk has one sample: 0-dim tensors or ndarrays computed by every replica may be a
    per-chunk loss or a per-sample output whose batch dimension ``squeeze()`` removed. Noted in
    ``ctx.squeezed`` (gather warns once for all of them), unless every replica returned what it
    received (a buffer, a broadcast input)."""
    if not all(isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 for v in values):
        return  # Python numbers are counts or constants (_gather_ints), not squeezed tensors
    if _one_value(values, ctx):
        return
    summed = ctx.scalars == "sum" or not any(
        v.dtype.is_floating_point or v.dtype.is_complex
        if isinstance(v, torch.Tensor)
        else np.issubdtype(v.dtype, np.inexact)
        for v in values
    )
    ctx.squeezed.append((fmt(path), "sum" if summed else "mean"))


def _one_value(values: list[Any], ctx: _Ctx) -> bool:
    """Whether every replica returned the same value as received, not one it computed: one
    object (an input or buffer on the module's own device), or each replica's copy of one
    buffer, parameter or broadcast input (``ctx.origins``, when the wrapper made the copies)."""
    first = values[0]
    if all(v is first for v in values):
        return True
    origins = getattr(ctx, "origins", None)
    if origins is None or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    return origins.one_value(values)


def _booleans_differ(values: list[Any], path: _Path) -> ValueError:
    where = fmt(path)
    found = ", ".join(f"replica {i}: {bool(v)}" for i, v in enumerate(values))
    return ValueError(
        f"{where}: the replicas returned different booleans ({found}); expected one value, "
        f"since a boolean is never averaged or summed and one device returns a single one. "
        f"Say how to combine them: output_rules={{{where!r}: 'all'}} (true if every chunk's "
        f"is, e.g. all finite) or {{{where!r}: 'any'}} (e.g. any NaN), or 'list' for one per "
        f"replica; or return a tensor with the batch dimension"
    )


def _is_bool(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)  # bool tensors, bool ndarrays and np.bool_
    return isinstance(value, bool) or dtype is torch.bool or bool(dtype == np.bool_)
