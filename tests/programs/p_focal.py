"""Focal loss: a classifier trained with the focal loss over its logits, per-class weights.

Source: clcarwin/focal_loss_pytorch focalloss.py

Ported: ``FocalLoss(gamma, alpha)`` (``-(1 - pt) ** gamma * log(pt)``, each target's class
weight ``alpha``, averaged over the samples), computed on the gathered logits of a small
classifier, as the repository's test script does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class FocalLoss(nn.Module):
    def __init__(self, gamma: float, alpha: list[float]) -> None:
        super().__init__()
        self.gamma = gamma
        self.alpha = torch.tensor(alpha)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logpt = F.log_softmax(logits, dim=1).gather(1, target.view(-1, 1)).view(-1)
        pt = logpt.exp()
        logpt = logpt * self.alpha.gather(0, target)
        return (-1 * (1 - pt) ** self.gamma * logpt).mean()


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(33)
    return [
        (torch.randn(9, 6, generator=gen), torch.randint(0, 3, (9,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    x, target = batch
    logits = run(x)
    loss = FocalLoss(2.0, [0.25, 0.5, 0.25])(logits, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "logits": logits.detach()}
