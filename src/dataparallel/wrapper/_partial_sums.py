"""Losses that are partial sums: a call that passes ``num_items_in_batch``.

transformers' ``Trainer`` passes ``num_items_in_batch`` (the labelled-token count of the whole
batch ``N``) to every model whose ``forward`` takes ``**kwargs``, in training, ``evaluate`` and
``predict``. A causal LM then returns its token sum over ``N``: each replica's loss is a part of
the one-device loss, and the chunk-weighted mean (the default for scalars) would divide it by
the number of replicas, and every gradient with it. A sequence classifier takes the keyword and
ignores it: its loss is a mean over the chunk, and summing it would be as wrong.

Both are right at once when each replica receives its share of the count,
``N * w_i / W`` (``w_i`` its chunk's weight in the mean: its size, or what ``scalar_weights``
returns; ``W`` their total): the mean ``sum(w_i * S_i / (N * w_i / W)) / W`` is
``sum(S_i) / N``, the sum of the partial sums, with the same gradients; a loss that ignores the
count keeps its mean; other scalar outputs are untouched. So, unless the user chose
``scalars``, ``output_rules`` or ``gather=False``, the wrapper passes each replica its share.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dataparallel.gather import chunk_weights

__all__ = [
    "COUNT_KEYWORD",
    "DEFAULT_SCALARS",
    "accepts_keyword",
    "shared_counts",
    "shares_count",
    "summing_note",
    "weight_total",
]

COUNT_KEYWORD = "num_items_in_batch"


class _DefaultScalars(str):
    """``"mean"``, as the default of ``scalars``: told apart by identity from a ``"mean"`` the
    user passed or assigned, which is an explicit choice and is kept."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'mean'"

    def __reduce__(self) -> str:
        # pickled and copied as the one default (by name), so a copied wrapper keeps it
        return "DEFAULT_SCALARS"


DEFAULT_SCALARS: str = _DefaultScalars("mean")

# forward function -> whether it takes COUNT_KEYWORD (by name, or through **kwargs); weak, so
# a forward function (and what its closure holds) is never kept alive by this table
_ACCEPTS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def accepts_keyword(module: nn.Module, name: str = COUNT_KEYWORD) -> bool:
    """Whether ``module``'s ``forward`` takes the keyword ``name`` (by name or ``**kwargs``).

    Read once per forward function: only calls that pass the keyword ask.

    >>> class Net(nn.Module):
    ...     def forward(self, x, **kwargs):
    ...         return x
    >>> accepts_keyword(Net()), accepts_keyword(nn.Linear(1, 1))
    (True, False)
    """
    forward = module.forward
    key = getattr(forward, "__func__", forward)
    found = _ACCEPTS.get(key)
    if found is None:
        try:
            params = inspect.signature(forward).parameters.values()
        except (TypeError, ValueError):  # no signature to read: trust the call
            found = True
        else:
            found = any(
                p.kind is p.VAR_KEYWORD
                or (p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
                for p in params
            )
        # a callable that takes no weak reference is read again next time
        with contextlib.suppress(TypeError):
            _ACCEPTS[key] = found
    return found


def shares_count(
    kwargs: Mapping[str, Any], module: Any, scalars: str, default_gather: bool, chunks: int
) -> bool:
    """Whether a call's chunks each get their share of ``num_items_in_batch``: it is passed
    (not None) to a module that takes it, ``scalars`` is the default, the built-in gather will
    take the mean (``default_gather``: no ``output_rules``, ``gather=False`` or override) and
    the call has two chunks or more."""
    return (
        kwargs[COUNT_KEYWORD] is not None
        and scalars is DEFAULT_SCALARS
        and default_gather
        and chunks > 1
        and accepts_keyword(module)
    )


def weight_total(
    batch_size: int,
    waves: Sequence[Sequence[Any]],
    scalar_weights: Callable[..., Any] | None,
    scatter: Callable[[Any], tuple[Sequence[Any], Sequence[Any]]],
) -> float:
    """The total weight of a call's chunks in the scalars' mean: the batch size, or the sum
    of ``scalar_weights`` over every chunk of every wave (each wave scattered once more here,
    by ``scatter(wave) -> (chunk_args, chunk_kwargs)``: only a call that combines waves,
    ``scalar_weights`` and the count pays it); 0 for one wave with ``scalar_weights``, whose
    total the pipeline reads from that wave's weights as it goes."""
    if scalar_weights is None:
        return float(batch_size)
    if len(waves) == 1:
        return 0.0
    return float(sum(sum(chunk_weights(scalar_weights, *scatter(wave))) for wave in waves))


def shared_counts(
    kwargs: Sequence[Mapping[str, Any]], weights: Sequence[float], total: float
) -> list[dict[str, Any]]:
    """Each chunk's keyword arguments with ``num_items_in_batch`` replaced by its share,
    ``count * weight / total`` (a float tensor for a tensor count, on its device; a float for a
    number). The dicts are copies: a chunk's kwargs may be the caller's own dict.

    >>> shared_counts([{"num_items_in_batch": 12}] * 2, [3, 1], 4)
    [{'num_items_in_batch': 9.0}, {'num_items_in_batch': 3.0}]
    """
    shared = []
    for kw, weight in zip(kwargs, weights, strict=True):
        one = dict(kw)
        one[COUNT_KEYWORD] = one[COUNT_KEYWORD] * (weight / total)
        shared.append(one)
    return shared


def summing_note(value: Any) -> str:
    """What ``explain`` says about a call that passes ``num_items_in_batch``."""
    found = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    return (
        f"{COUNT_KEYWORD}={found!r} is passed: each replica receives its share (count * its "
        f"chunk's weight in the mean / the total: its chunk size / the batch size unless "
        f"scalar_weights is set), so the weighted mean of the replicas' losses is the sum of "
        f"their partial sums, the one-device loss (a loss that ignores the count keeps its "
        f"mean); choose scalars= explicitly to pass the count unchanged"
    )
