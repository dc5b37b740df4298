"""scalar_weights (gather and DataParallel) and DataParallelCriterion's exact token means,
without the integration suite's model packages."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dataparallel as dp


def test_gather_weighs_scalars_by_the_given_counts() -> None:
    parts = [
        {"loss": torch.tensor(2.0), "y": torch.ones(2, 1)},
        {"loss": torch.tensor(5.0), "y": torch.zeros(3, 1)},
    ]
    out = dp.gather(parts, "cpu", chunk_sizes=[2, 3], scalar_weights=[3, 1])
    assert out["loss"].item() == pytest.approx((2 * 3 + 5 * 1) / 4)
    assert out["y"].shape == (5, 1)
    assert dp.gather(parts, "cpu", chunk_sizes=[2, 3])["loss"].item() == pytest.approx(3.8)


def test_a_chunk_of_weight_zero_is_left_out_even_when_nan() -> None:
    loss = torch.tensor(1.5, requires_grad=True)
    nan = torch.tensor(float("nan"), requires_grad=True)
    out = dp.gather([loss, nan], "cpu", chunk_sizes=[2, 2], scalar_weights=[4, 0])
    assert out.item() == 1.5
    out.backward()
    assert loss.grad.item() == 1.0
    assert nan.grad is None  # no NaN gradient flows into the unlabelled chunk
    assert math.isnan(dp.gather([1.0, float("nan")], "cpu", chunk_sizes=[1, 1]))


@pytest.mark.parametrize("bad", [[1, -1], [1], [1, "x"], [1, float("inf")], [True, 1]])
def test_bad_scalar_weights_name_the_position(bad: list[object]) -> None:
    with pytest.raises(ValueError, match=r"scalar_weights"):
        dp.gather(
            [torch.tensor(1.0), torch.tensor(2.0)], "cpu", chunk_sizes=[1, 1], scalar_weights=bad
        )  # type: ignore[arg-type]


class MeanOverTokens(nn.Module):
    """A model computing its loss in forward as a mean over labelled tokens (-1 is padding)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.lin(x)
        loss = nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-1)
        return {"loss": loss, "logits": logits}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, 3, generator=gen)
    labels = torch.randint(0, 4, (5, 6), generator=gen)
    labels[:3, 1:] = -1  # the first chunk has few labelled tokens
    labels[4] = -1  # one sample with none
    return x, labels


def test_data_parallel_scalar_weights_give_the_one_device_token_mean() -> None:
    x, labels = _batch()
    model = MeanOverTokens()
    ref = model(x, labels)["loss"]
    # by default the loss is re-formed from cross_entropy's own ignore_index (-1, issue 59)
    plain = dp.DataParallel(model, ["cpu", "cpu", "cpu"])(x, labels)["loss"]
    assert plain.item() == pytest.approx(ref.item(), rel=1e-6)
    # scalar_weights replace that: chunk sizes are the wrong weights, and the unlabelled
    # chunk's NaN poisons the mean
    by_size = dp.DataParallel(model, ["cpu", "cpu", "cpu"], scalar_weights=lambda a, kw: 1)
    assert not math.isclose(by_size(x, labels)["loss"].item(), ref.item(), rel_tol=1e-3)
    wrapped = dp.DataParallel(
        model, ["cpu", "cpu", "cpu"], scalar_weights=lambda args, kw: (args[1] != -1).sum()
    )
    out = wrapped(x, labels)["loss"]  # the last chunk (one sample, no label) is NaN, weight 0
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    with pytest.raises(TypeError, match="scalar_weights: expected a function"):
        dp.DataParallel(model, ["cpu"], scalar_weights=3)  # type: ignore[arg-type]


class Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).transpose(1, 2)


@pytest.mark.parametrize("weighted", [False, True])
def test_criterion_is_exact_for_cross_entropy_with_ignore_index(weighted: bool) -> None:
    x, labels = _batch()
    weight = torch.tensor([0.5, 1.0, 2.0, 3.0]) if weighted else None
    criterion = nn.CrossEntropyLoss(weight=weight, ignore_index=-1)
    model = Logits()
    ref = criterion(model(x), labels)
    outputs = dp.DataParallel(model, ["cpu", "cpu:1"], gather=False)(x)
    loss = dp.DataParallelCriterion(criterion, ["cpu", "cpu:1"])(outputs, labels)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert criterion.reduction == "mean"


def test_a_criterion_of_your_own_keeps_the_chunk_weighted_mean() -> None:
    class Mine(nn.CrossEntropyLoss):
        def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return super().forward(input, target) * 2

    x, labels = _batch()
    model = Logits()
    outputs = dp.DataParallel(model, ["cpu", "cpu"], gather=False)(x[:4])
    crit = dp.DataParallelCriterion(Mine(ignore_index=-1), ["cpu", "cpu"])
    parts = [Mine(ignore_index=-1)(o, t) for o, t in zip(outputs, labels[:4].split(2), strict=True)]
    assert crit(outputs, labels[:4]).item() == pytest.approx(((parts[0] + parts[1]) / 2).item())
