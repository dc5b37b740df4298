"""DataParallelCriterion follows its loss (issue 20, item 7).

A change made to the user's loss object after the criterion was built is honoured on the next
call. Oracle: the same loss on the one-device output, for the loss and for the gradients of the
model's parameters; three device lists, an uneven batch (11 rows).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import dataparallel as dp

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
ROWS, CLASSES = 11, 4


@pytest.fixture(params=DEVICE_LISTS, ids=lambda d: "+".join(d))
def devices(request: pytest.FixtureRequest) -> list[str]:
    return list(request.param)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    labels = torch.randint(0, CLASSES, (ROWS,))
    labels[[1, 6, 9]] = 2  # a class to ignore, spread over the chunks
    return torch.randn(ROWS, 5), labels


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(5, CLASSES)


def _loss_and_grads(
    model: nn.Module, run: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = run()
    loss.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    return loss.detach(), grads


def _check(devices: list[str], loss: nn.Module, crit: dp.DataParallelCriterion) -> None:
    """The criterion on ``devices`` equals ``loss`` on one device: value and gradients."""
    x, y = _batch()
    model = _model()
    wrapper = dp.DataParallel(model, devices, gather=False)
    got, got_grads = _loss_and_grads(model, lambda: crit(wrapper(x), y))
    want, want_grads = _loss_and_grads(model, lambda: loss(model(x), y))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grads, want_grads)


def test_label_smoothing_set_later_is_honoured(devices: list[str]) -> None:
    ce = nn.CrossEntropyLoss()
    crit = dp.DataParallelCriterion(ce, devices)
    _check(devices, ce, crit)
    ce.label_smoothing = 0.3  # the case: 2.014 against 1.913 before
    _check(devices, ce, crit)


@pytest.mark.parametrize(
    "change",
    [
        {"ignore_index": 2},
        {"label_smoothing": 0.2, "ignore_index": 2},
        {"weight": torch.tensor([0.5, 1.0, 2.0, 3.0])},
        {"weight": torch.tensor([0.5, 1.0, 2.0, 3.0]), "ignore_index": 2},
        {"reduction": "sum"},
        {"reduction": "none"},
        {"reduction": "sum", "label_smoothing": 0.1},
    ],
    ids=lambda c: "+".join(c),
)
def test_each_change_is_honoured(devices: list[str], change: dict[str, object]) -> None:
    ce = nn.CrossEntropyLoss()
    crit = dp.DataParallelCriterion(ce, devices)
    _check(devices, ce, crit)  # warm: replicas built for the loss as it was
    for name, value in change.items():
        setattr(ce, name, value)
    _check(devices, ce, crit)


def test_a_weight_replaced_in_place_and_changed_back(devices: list[str]) -> None:
    ce = nn.CrossEntropyLoss(weight=torch.ones(CLASSES))
    crit = dp.DataParallelCriterion(ce, devices)
    _check(devices, ce, crit)
    with torch.no_grad():
        ce.weight.copy_(torch.tensor([3.0, 1.0, 0.5, 2.0]))  # type: ignore[union-attr]
    _check(devices, ce, crit)
    ce.reduction = "sum"
    _check(devices, ce, crit)
    ce.reduction = "mean"
    _check(devices, ce, crit)


def test_nll_loss_changes_are_honoured(devices: list[str]) -> None:
    class LogSoftmaxLoss(nn.Module):
        def __init__(self, nll: nn.NLLLoss) -> None:
            super().__init__()
            self.nll = nll

        def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.nll(out.log_softmax(-1), y)

    nll = nn.NLLLoss()
    _check(devices, LogSoftmaxLoss(nll), dp.DataParallelCriterion(LogSoftmaxLoss(nll), devices))
    crit = dp.DataParallelCriterion(nll, devices)
    x, y = _batch()
    out = dp.DataParallel(_model(), devices, gather=False)(x)
    before = crit(out, y)
    nll.ignore_index = 2
    nll.weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    after = crit(out, y)
    logits = _model()(x)
    torch.testing.assert_close(after, nll(logits, y))
    assert not torch.allclose(before, after)


def test_a_replaced_criterion_is_used(devices: list[str]) -> None:
    crit = dp.DataParallelCriterion(nn.CrossEntropyLoss(), devices)
    _check(devices, nn.CrossEntropyLoss(), crit)
    smoothed = nn.CrossEntropyLoss(label_smoothing=0.25, ignore_index=2)
    crit.criterion = smoothed
    _check(devices, smoothed, crit)
    summed = nn.CrossEntropyLoss(reduction="sum")
    crit.criterion = summed
    assert crit.scalars == "sum"
    _check(devices, summed, crit)


def test_the_users_loss_is_never_written(devices: list[str]) -> None:
    ce = nn.CrossEntropyLoss(weight=torch.ones(CLASSES), ignore_index=2, label_smoothing=0.1)
    before = dict(ce.__dict__)
    buffers = dict(ce._buffers)
    crit = dp.DataParallelCriterion(ce, devices)
    _check(devices, ce, crit)
    assert ce.__dict__ == before
    assert ce._buffers == buffers
    assert ce.reduction == "mean"
    assert list(crit.state_dict()) == ["criterion.weight"]


def test_scalars_given_stays_and_none_follows_the_reduction() -> None:
    ce = nn.CrossEntropyLoss()
    follows = dp.DataParallelCriterion(ce, ["cpu", "cpu"])
    fixed = dp.DataParallelCriterion(ce, ["cpu", "cpu"], scalars="mean")
    assert follows.scalars == fixed.scalars == "mean"
    ce.reduction = "sum"
    assert follows.scalars == "sum"
    assert fixed.scalars == "mean"
    fixed.scalars = "sum"
    assert fixed.scalars == "sum"
    with pytest.raises(ValueError, match="scalars: expected one of"):
        fixed.scalars = "median"
