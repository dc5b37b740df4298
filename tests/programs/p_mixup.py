"""mixup: each batch mixed with a permutation of itself, the loss mixed the same way.

Source: facebookresearch/mixup-cifar10 train.py

Ported: ``mixup_data`` (a Beta-distributed weight, a random permutation of the batch, the
inputs mixed), ``mixup_criterion`` (the two cross-entropies mixed by the same weight), and the
step with SGD and weight decay; the mixing is done before the wrapped call, as in the script,
so the wrapper sees an ordinary batch. A small convolutional classifier stands for the ResNet.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def mixup_data(x: torch.Tensor, y: torch.Tensor, alpha: float, rng: np.random.Generator) -> Any:
    lam = float(rng.beta(alpha, alpha))
    index = torch.randperm(x.size(0))
    return lam * x + (1 - lam) * x[index, :], y, y[index], lam


def mixup_criterion(
    pred: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float
) -> torch.Tensor:
    return lam * F.cross_entropy(pred, y_a) + (1 - lam) * F.cross_entropy(pred, y_b)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 10),
    )


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(31)
    return [
        (torch.randn(7, 3, 8, 8, generator=gen), torch.randint(0, 10, (7,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    rng = memo.setdefault("rng", np.random.default_rng(0))
    inputs, targets = batch
    inputs, targets_a, targets_b, lam = mixup_data(inputs, targets, 1.0, rng)
    outputs = run(inputs)
    loss = mixup_criterion(outputs, targets_a, targets_b, lam)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "outputs": outputs.detach()}
