"""``dataparallel.gather._loss``: a token mean is exact on many devices.

The oracle is the loss on one device over the whole batch; the parts are computed chunk by
chunk (as replicas would) and combined. Chunks are cut unevenly and hold different numbers of
ignored targets and class weights, where a chunk-weighted mean of means would be off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dataparallel.gather._loss import (
    SumAndCount,
    chunk_weights,
    combine,
    is_exact_mean,
)

CUTS = [5, 2, 3]  # chunk sizes of a batch of 10


def _by_parts(criterion: nn.Module, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    assert is_exact_mean(criterion)
    parts = SumAndCount(criterion)
    pieces = [parts(o, t) for o, t in zip(output.split(CUTS), target.split(CUTS), strict=True)]
    return combine(pieces, torch.device("cpu"))


def _targets() -> torch.Tensor:
    target = torch.randint(0, 4, (10,))
    target[:4] = -100  # the first chunk is mostly padding, the others have none
    return target


@pytest.mark.parametrize(
    "criterion",
    [
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 3.0])),
        nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=-100),
        nn.NLLLoss(weight=torch.tensor([0.2, 1.0, 4.0, 1.0])),
    ],
    ids=["ce", "ce-weight", "ce-smoothing", "nll-weight"],
)
def test_class_index_losses_match_one_device(criterion: nn.Module) -> None:
    torch.manual_seed(0)
    logits = torch.randn(10, 4, requires_grad=True)
    target = _targets()

    def output() -> torch.Tensor:  # a fresh graph for each of the two backward passes
        return logits.log_softmax(1) if isinstance(criterion, nn.NLLLoss) else logits

    expected = criterion(output(), target)
    (grad_expected,) = torch.autograd.grad(expected, logits)
    got = _by_parts(criterion, output(), target)
    (grad_got,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad_got, grad_expected)


def test_elementwise_losses_divide_by_the_element_count() -> None:
    torch.manual_seed(0)
    output, target = torch.randn(10, 3), torch.randn(10, 3)
    for criterion in (nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss()):
        torch.testing.assert_close(_by_parts(criterion, output, target), criterion(output, target))


def test_the_users_loss_is_read_at_each_call_and_never_written() -> None:
    torch.manual_seed(0)
    criterion = nn.CrossEntropyLoss()
    parts = SumAndCount(criterion)
    output, target = torch.randn(10, 4), _targets()
    criterion.label_smoothing = 0.2  # a change made after the parts were built
    total, count = parts(output, target)
    torch.testing.assert_close(total / count, criterion(output, target))
    assert criterion.reduction == "mean"


class OwnForward(nn.CrossEntropyLoss):
    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(output, target) * 2


class SameForward(nn.CrossEntropyLoss):
    pass


@pytest.mark.parametrize(
    ("criterion", "exact"),
    [
        (nn.CrossEntropyLoss(), True),
        (nn.MSELoss(), True),
        (SameForward(), True),
        (nn.CrossEntropyLoss(reduction="sum"), False),
        (nn.CTCLoss(), False),  # its mean is over samples: chunk weighting is exact already
        (OwnForward(), False),  # the user's forward: its reduction may mean anything
        (lambda o, t: (o - t).mean(), False),
    ],
    ids=["ce", "mse", "subclass", "sum", "ctc", "own-forward", "function"],
)
def test_is_exact_mean_takes_only_torchs_mean_losses(criterion: Any, exact: bool) -> None:
    assert is_exact_mean(criterion) is exact
    assert is_exact_mean(criterion) is exact


def test_is_exact_mean_follows_a_later_change_of_reduction() -> None:
    criterion = nn.CrossEntropyLoss()
    criterion.reduction = "sum"
    assert not is_exact_mean(criterion)


def test_chunk_weights_call_the_function_on_each_chunks_arguments() -> None:
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        seen.append((args, kwargs))
        return (args[0] != 0).sum()  # a 0-dim tensor: read as a float

    x = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    chunks = [(x[:2],), x[2:]]  # a bare argument is taken as one positional argument
    weights = chunk_weights(tokens, chunks, [{"k": 1}, {"k": 2}])
    assert weights == [4.0, 0.0]
    assert all(type(w) is float for w in weights)
    assert [len(args) for args, _ in seen] == [1, 1]
    assert [kw for _, kw in seen] == [{"k": 1}, {"k": 2}]
