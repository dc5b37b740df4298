"""What torch's loss functions reduce by: each chunk's sum and denominator, and the criterion's.

A torch mean is the summed losses over a denominator (``denominator``); each chunk's two are
kept apart, and the one-device mean is the sum of the sums over the sum of the denominators.
Two callers: a loss function called in forward on a chunk's marked data (``_marks``), and
``DataParallelCriterion``'s loss, read as it is on each call (:class:`SumAndCount`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LOSSES",
    "ScalarWeights",
    "SumAndCount",
    "chunk_weights",
    "combine",
    "denominator",
    "is_exact_mean",
    "reduce_apart",
]

# torch's loss functions (their modules call them): each dispatches on a marked argument
_LOSS_NAMES = (
    "cross_entropy nll_loss ctc_loss mse_loss l1_loss smooth_l1_loss huber_loss "
    "binary_cross_entropy binary_cross_entropy_with_logits kl_div soft_margin_loss "
    "multilabel_soft_margin_loss multi_margin_loss poisson_nll_loss gaussian_nll_loss "
    "hinge_embedding_loss margin_ranking_loss cosine_embedding_loss"
)
LOSSES = {getattr(F, n): inspect.signature(getattr(F, n)) for n in _LOSS_NAMES.split()}

# DataParallel's scalar_weights: a chunk's positional arguments and keyword arguments -> its
# weight in the mean of scalar outputs (a number or a 0-dim tensor).
ScalarWeights = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def reduce_apart(func: Any, a: dict[str, Any]) -> tuple[torch.Tensor, Any, bool]:
    """A loss function's call (its bound ``a``rguments, plain) as ``(total, denominator,
    elements)``: ``elements`` for ``reduction="none"`` (``total`` the per-element losses), a
    ``None`` denominator for a sum."""
    reduction = a.get("reduction", "mean")
    a["reduction"] = "none"
    losses = func(**a)
    if reduction == "none":
        return losses, None, True
    if func is F.ctc_loss and reduction == "mean":  # a mean over samples of loss / length
        lengths = torch.as_tensor(a["target_lengths"], device=losses.device)
        total = (losses / lengths.clamp(min=1).to(losses.dtype)).sum()
        return total, losses.shape[0] if losses.ndim else 1, False
    if reduction == "sum":
        return losses.sum(), None, False
    if reduction == "batchmean":
        return losses.sum(), a["input"].shape[0] if a["input"].ndim else 1, False
    by_class = func in (F.cross_entropy, F.nll_loss)
    return losses.sum(), denominator(by_class, a["target"], a, losses), False


def denominator(by_class: bool, target: Any, a: Any, losses: torch.Tensor) -> Any:
    """What torch's mean divides the summed losses by: for cross-entropy and NLL with
    class-index targets (``by_class``), the summed class weights (``a["weight"]``) of the
    targets other than ``a["ignore_index"]``; the count of loss elements otherwise."""
    if by_class and isinstance(target, torch.Tensor) and not target.is_floating_point():
        keep = target != a["ignore_index"]
        weight = a["weight"]
        if weight is None:
            return keep.sum().to(losses.dtype)
        safe = torch.where(keep, target, torch.zeros_like(target))
        return (weight.to(losses.dtype)[safe] * keep).sum()
    return losses.numel()


# -- DataParallelCriterion ---------------------------------------------------------------------


def is_exact_mean(criterion: Any) -> TypeGuard[nn.modules.loss._Loss]:
    """True when ``criterion``, as it stands now (read on every call), is one of torch's own
    mean-reduced losses: not the user's (whose ``reduction`` may mean something else), nor
    ``CTCLoss`` (a mean over samples, which chunk weighting already gets exactly)."""
    if not isinstance(criterion, nn.modules.loss._Loss) or criterion.reduction != "mean":
        return False
    if isinstance(criterion, nn.CTCLoss):
        return False
    # The class whose forward runs must be torch's: a subclass that overrides forward is the
    # user's, and its reduction attribute may not mean what torch's does.
    owner = next(base for base in type(criterion).__mro__ if "forward" in vars(base))
    return bool(owner.__module__.startswith("torch.nn."))


def _unreduced(criterion: nn.Module) -> Any:
    """A view of ``criterion`` with ``reduction="none"`` (a copy of its ``__dict__`` as it is
    now): the user's object, which another thread may be using, is never written."""
    view = object.__new__(type(criterion))
    view.__dict__.update(criterion.__dict__)
    view.__dict__["reduction"] = "none"
    return view


class SumAndCount(nn.Module):
    """Runs a mean-reduced torch loss as ``(sum of its losses, its denominator)``; holds the
    user's loss itself, so later changes to it (``label_smoothing``, ``weight``) are honoured."""

    def __init__(self, criterion: nn.Module) -> None:
        super().__init__()
        self.criterion = criterion
        self.by_class = isinstance(criterion, (nn.NLLLoss, nn.CrossEntropyLoss))

    def forward(self, output: Any, target: Any, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of the unreduced losses, the denominator torch's mean divides by)``."""
        criterion = _unreduced(self.criterion)
        losses = criterion(output, target, *rest)
        total = losses.sum()
        a = {"weight": getattr(criterion, "weight", None)}
        a["ignore_index"] = getattr(criterion, "ignore_index", None)
        count = denominator(self.by_class, target, a, losses)
        if not isinstance(count, torch.Tensor):
            count = torch.tensor(float(count), dtype=total.dtype, device=total.device)
        return total, count


def combine(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], target: torch.device) -> Any:
    """The global sum divided once by the global denominator, on ``target``."""
    total = sum([t.to(target) for t, _ in parts[1:]], parts[0][0].to(target))
    return total / sum([c.to(target) for _, c in parts[1:]], parts[0][1].to(target))


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
