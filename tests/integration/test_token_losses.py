"""Losses that are means over tokens: GPT-2 with padded labels (-100) on 2 and 3 replicas gives
the one-device loss and gradients to 1e-6 relative, three ways."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._models import text_batch, tiny_gpt2
from ._oracle import LAYOUTS, record

pytest.importorskip("transformers", reason="transformers is not installed")

RTOL = 1e-6


def _labelled(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A chunk's weight: its labels that count after GPT-2's shift (not -100)."""
    return (kwargs["labels"][:, 1:] != -100).sum()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _compare_run(case: str, ref: nn.Module, par: nn.Module, loss_ref: Any, loss_par: Any) -> None:
    worst = _rel(loss_par.detach(), loss_ref.detach())
    assert worst <= RTOL, f"loss {loss_par.item()} != {loss_ref.item()}"
    loss_ref.backward()
    loss_par.backward()
    for (name, p), q in zip(ref.named_parameters(), par.parameters(), strict=True):
        diff = _rel(q.grad, p.grad)
        assert diff <= RTOL, f"{name}.grad differs by {diff} (relative)"
        worst = max(worst, diff)
    record(case, worst)


def _uneven(batch: int) -> dict[str, torch.Tensor]:
    data = text_batch(batch, seed=5)
    # the chunks must hold different numbers of labelled tokens, or a sample mean is exact
    counts = [int((lab[1:] != -100).sum()) for lab in data["labels"]]
    assert len(set(counts)) > 1
    return data


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_the_default_weighs_by_label_tokens(devices: list[str], batch: int) -> None:
    """By default a call that passes labels weighs each chunk's loss by its label tokens
    (issue 49): exact with nothing set. A chunk-size weighting, asked for with
    scalar_weights, is close, not equal: why the rule exists."""
    data = _uneven(batch)
    ref = tiny_gpt2()
    par = copy.deepcopy(ref)
    loss_ref = ref(**data, use_cache=False).loss
    loss_par = dp.DataParallel(par, devices)(**data, use_cache=False).loss
    _compare_run("token loss: default", ref, par, loss_ref, loss_par)
    by_size = dp.DataParallel(ref, devices, scalar_weights=lambda a, kw: len(kw["labels"]))
    out = by_size(**data, use_cache=False).loss
    assert _rel(out.detach(), loss_ref.detach()) > 1e-4


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_scalar_weights_counts_labelled_tokens(devices: list[str], batch: int) -> None:
    data = _uneven(batch)
    ref = tiny_gpt2()
    par = copy.deepcopy(ref)
    wrapped = dp.DataParallel(par, devices, scalar_weights=_labelled)
    loss_ref = ref(**data, use_cache=False).loss
    loss_par = wrapped(**data, use_cache=False).loss
    _compare_run("token loss: scalar_weights", ref, par, loss_ref, loss_par)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_num_items_in_batch_with_scalars_sum(devices: list[str], batch: int) -> None:
    """transformers' recipe: each chunk's loss is its sum over the global count of labelled
    tokens, so the chunks' losses add up to the global mean: gather them with scalars="sum"."""
    data = _uneven(batch)
    count = int((data["labels"][:, 1:] != -100).sum())
    ref = tiny_gpt2()
    par = copy.deepcopy(ref)
    wrapped = dp.DataParallel(par, devices, scalars="sum")
    loss_ref = ref(**data, use_cache=False).loss
    loss_par = wrapped(**data, use_cache=False, num_items_in_batch=count).loss
    _compare_run("token loss: num_items_in_batch", ref, par, loss_ref, loss_par)


class ShiftedLogits(nn.Module):
    """GPT-2 returning next-token logits as (batch, vocab, positions), the shape
    CrossEntropyLoss takes, so the loss is computed per device by DataParallelCriterion."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return logits.logits[:, :-1].transpose(1, 2)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.parametrize("weighted", [False, True], ids=["ignore_index", "class-weight"])
def test_criterion_sums_then_divides_once(devices: list[str], batch: int, weighted: bool) -> None:
    data = _uneven(batch)
    targets = data.pop("labels")[:, 1:]
    weight = torch.rand(61, generator=torch.Generator().manual_seed(3)) + 0.5
    criterion = nn.CrossEntropyLoss(weight=weight if weighted else None, ignore_index=-100)
    ref = ShiftedLogits(tiny_gpt2())
    par = copy.deepcopy(ref)
    model = dp.DataParallel(par, devices, gather=False)
    loss_ref = criterion(ref(**data), targets)
    outputs = model(**data)
    assert isinstance(outputs, dp.DeviceOutputs)
    loss_par = dp.DataParallelCriterion(criterion, devices)(outputs, targets)
    assert criterion.reduction == "mean"  # the user's criterion is left as it was
    _compare_run(
        f"token loss: DataParallelCriterion {'weight' if weighted else 'ignore'}",
        ref,
        par,
        loss_ref,
        loss_par,
    )


@pytest.mark.parametrize(
    "criterion",
    [
        nn.NLLLoss(ignore_index=0),
        nn.MSELoss(),
        nn.SmoothL1Loss(),
        nn.KLDivLoss(reduction="batchmean"),
    ],
    ids=["nll-ignore", "mse", "smooth-l1", "kl-batchmean"],
)
def test_criterion_matches_one_device_for_torch_losses(criterion: nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 3, generator=gen)
    net = nn.Linear(3, 4)
    if isinstance(criterion, nn.NLLLoss):

        def head(t: torch.Tensor) -> torch.Tensor:
            return net(t).log_softmax(-1).transpose(1, 2)

        target: torch.Tensor = torch.randint(0, 4, (7, 4), generator=gen)
        target[:4] = 0  # the first chunk holds mostly ignored targets
    else:

        def head(t: torch.Tensor) -> torch.Tensor:
            return net(t).log_softmax(-1)

        target = torch.rand(7, 4, 4, generator=gen).softmax(-1)
    module = _Lambda(head)
    ref = criterion(module(x), target)
    outputs = dp.DataParallel(module, ["cpu", "cpu", "cpu"], gather=False)(x)
    loss = dp.DataParallelCriterion(criterion, ["cpu", "cpu", "cpu"])(outputs, target)
    assert _rel(loss.detach(), ref.detach()) <= RTOL
    record(f"criterion {type(criterion).__name__}", _rel(loss.detach(), ref.detach()))


class _Lambda(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
