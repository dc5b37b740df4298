"""Losses that are means over tokens, not samples: exact on many devices.

A chunk-weighted mean of per-chunk losses equals the one-device loss only when each chunk's
loss is a mean over its samples. A language model's loss is a mean over the tokens that are
not padding, and a class-weighted cross-entropy divides by the summed weights of the targets:
chunks hold different amounts of either, so weighting by chunk size is close but not exact.

The exact rule is to sum on each device and divide once by the global denominator. For
torch's own mean-reduced losses, ``DataParallelCriterion`` does that through
:class:`SumAndCount`: the criterion runs with ``reduction="none"``, each device returns the sum
of its losses and its share of the denominator (the summed class weights of the targets that
are not ``ignore_index`` for ``CrossEntropyLoss``/``NLLLoss`` with class-index targets, the
number of loss elements otherwise), and :func:`combine` divides the global sum by the global
denominator. The loss is read as it is on each call, never copied at construction: a change to
it made later (``loss.label_smoothing = 0.1``, ``loss.reduction = "sum"``) is honoured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
from torch import nn

__all__ = [
    "ScalarWeights",
    "SumAndCount",
    "chunk_weights",
    "combine",
    "exact_parts",
    "is_exact_mean",
]

# DataParallel's scalar_weights: a chunk's positional arguments and keyword arguments -> its
# weight in the mean of scalar outputs (a number or a 0-dim tensor).
ScalarWeights = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def is_exact_mean(criterion: Any) -> TypeGuard[nn.modules.loss._Loss]:
    """True when ``criterion`` is, as it stands now, one of torch's mean-reduced losses whose
    mean :class:`SumAndCount` can take exactly.

    Read on every call, so a change made to the loss after construction
    (``loss.reduction = "sum"``) is followed. False for anything else: a loss written by the
    user (whose ``reduction`` attribute, if any, may not mean what torch's does), another
    reduction, or ``CTCLoss`` (whose mean is a mean over samples, which chunk weighting
    already gets exactly).
    """
    if not isinstance(criterion, nn.modules.loss._Loss) or criterion.reduction != "mean":
        return False
    if isinstance(criterion, nn.CTCLoss):
        return False
    # The class whose forward runs must be torch's: a subclass that overrides forward is the
    # user's, and its reduction attribute may not mean what torch's does.
    owner = next(base for base in type(criterion).__mro__ if "forward" in vars(base))
    return bool(owner.__module__.startswith("torch.nn."))


def exact_parts(criterion: Callable[..., Any]) -> SumAndCount | None:
    """A :class:`SumAndCount` for ``criterion`` when :func:`is_exact_mean` holds, else
    ``None``."""
    return SumAndCount(criterion) if is_exact_mean(criterion) else None


def _unreduced(criterion: nn.Module) -> Any:
    """A view of ``criterion`` with ``reduction="none"``: a new object of its type whose
    ``__dict__`` is a copy of the criterion's as it is now (its parameter, buffer and hook
    tables shared), so its current ``weight``, ``ignore_index`` and ``label_smoothing`` apply
    and the criterion itself is never written (replica 0 is the user's own loss object, and
    another thread may be using it)."""
    view = object.__new__(type(criterion))
    view.__dict__.update(criterion.__dict__)
    view.__dict__["reduction"] = "none"
    return view


class SumAndCount(nn.Module):
    """Runs a mean-reduced torch loss as ``(sum of its losses, its denominator)``.

    It holds the user's loss itself, not a copy: each call runs a ``reduction="none"`` view of
    the loss as it is at that moment, so later changes to it (``label_smoothing``,
    ``ignore_index``, ``weight``) are honoured. The user's object is never changed.
    """

    def __init__(self, criterion: nn.Module) -> None:
        super().__init__()
        self.criterion = criterion
        self.by_class = isinstance(criterion, (nn.NLLLoss, nn.CrossEntropyLoss))

    def forward(self, output: Any, target: Any, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of the unreduced losses, the denominator torch's mean divides by)``."""
        criterion = _unreduced(self.criterion)
        losses = criterion(output, target, *rest)
        total = losses.sum()
        if self.by_class and isinstance(target, torch.Tensor) and not target.is_floating_point():
            keep: torch.Tensor = target != criterion.ignore_index
            weight = criterion.weight
            if weight is None:
                count = keep.sum().to(total.dtype)
            else:
                safe = torch.where(keep, target, torch.zeros_like(target))
                count = (weight.to(total.dtype)[safe] * keep).sum()
        else:
            count = torch.tensor(float(losses.numel()), dtype=total.dtype, device=total.device)
        return total, count


def combine(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], target: torch.device) -> Any:
    """The global sum divided once by the global denominator, on ``target``."""
    totals = [total.to(target) for total, _ in parts]
    counts = [count.to(target) for _, count in parts]
    total = totals[0]
    for t in totals[1:]:
        total = total + t
    count = counts[0]
    for c in counts[1:]:
        count = count + c
    return total / count


def chunk_weights(
    fn: ScalarWeights, inputs: Sequence[Any], kwargs: Sequence[dict[str, Any]]
) -> list[float]:
    """``fn`` called on each chunk's arguments, as Python floats (one sync per chunk on CUDA).

    A chunk's arguments are its tuple of positional arguments and its dict of keyword
    arguments, on its device, exactly as its replica receives them.
    """
    weights = []
    for args, kw in zip(inputs, kwargs, strict=True):
        value = fn(args if isinstance(args, tuple) else (args,), kw)
        weights.append(float(value) if isinstance(value, torch.Tensor) else value)
    return weights
