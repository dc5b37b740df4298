"""kuangliu/pytorch-cifar: a ResNet with BatchNorm trained with ``torch.nn.DataParallel``.

Source: kuangliu/pytorch-cifar main.py

Ported: the pre-activation-free ``BasicBlock`` (conv, BatchNorm, ReLU, conv, BatchNorm, the
shortcut with a 1x1 conv and BatchNorm where the shape changes), the ResNet stem and pooling,
and the script's step (SGD with momentum and weight decay, cross-entropy). The script wraps
``net = torch.nn.DataParallel(net)``, where each replica normalises its own chunk; the port
converts the BatchNorm layers with ``nn.SyncBatchNorm.convert_sync_batchnorm`` first (the
guide's way to the one-device statistics), so the run, running statistics included, is one
device's. Two blocks, eight channels, 8 x 8 images.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 12, stride=2)
        self.linear = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer2(self.layer1(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def build() -> nn.Module:
    torch.manual_seed(0)
    return ResNet()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model), devices)


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(27)
    return [
        (torch.randn(7, 3, 8, 8, generator=gen), torch.randint(0, 10, (7,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    inputs, targets = batch
    outputs = run(inputs)
    loss = F.cross_entropy(outputs, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "outputs": outputs.detach()}
