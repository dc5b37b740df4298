"""PyTorch's ImageNet example: the canonical ``torch.nn.DataParallel`` training script.

Source: pytorch/examples imagenet/main.py

Ported: ``model = torch.nn.DataParallel(model)``, the training step (cross-entropy, SGD with
momentum and weight decay, a learning rate decayed by ``StepLR``), and ``accuracy(output,
target, topk=(1, 5))`` on the gathered output, as the script's ``train`` computes its
meters; an AlexNet-like network without BatchNorm or dropout at 8 x 8 (the script's
``features`` wrapped alone for AlexNet and VGG is a detail left out).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def accuracy(
    output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...]
) -> list[torch.Tensor]:
    with torch.no_grad():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0) * (100.0 / target.size(0)) for k in topk]


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 12, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(48, 10),
    )


def optimizers(model: nn.Module) -> list[Any]:
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(36)
    return [
        (torch.randn(7, 3, 8, 8, generator=gen), torch.randint(0, 10, (7,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    scheduler = memo.setdefault(
        "scheduler", torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    )
    images, target = batch
    output = run(images)
    loss = F.cross_entropy(output, target)
    acc1, acc5 = accuracy(output, target, topk=(1, 5))
    opt.zero_grad()
    loss.backward()
    opt.step()
    scheduler.step()
    return {"loss": loss.detach(), "acc1": acc1, "acc5": acc5}
