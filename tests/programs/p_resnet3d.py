"""kenshohara's 3D-ResNets: a video classifier of 3-d convolutions, trained on clips.

Source: kenshohara/3D-ResNets-PyTorch training.py

Ported: models/resnet.py's ``BasicBlock`` (3 x 3 x 3 convolutions, ``BatchNorm3d``, the
shortcut a 1 x 1 x 1 convolution where the shape changes, type B) and ``ResNet`` (``conv1``
of ``(7, 7, 7)`` with stride ``(1, 2, 2)``, the max pool, four stages, ``AdaptiveAvgPool3d``,
``fc``) at one block per stage and narrow widths, utils.py's ``calculate_accuracy`` (top-1
from ``topk``), and train_epoch's step: ``CrossEntropyLoss`` outside the model, SGD with
momentum and weight decay. Clips of 4 frames at 16 x 16, in float64 (in float32 the run
drifts from one device's by 2e-5 in three steps at lr 0.05, on summation order). The port
converts BatchNorm to ``nn.SyncBatchNorm`` (one device's statistics, the guide's way).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dataparallel as dp

CLASSES, BATCH = 5, 7


def conv3x3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv3d:
    return nn.Conv3d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self, in_planes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm3d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3x3(planes, planes)
        self.bn2 = nn.BatchNorm3d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            residual = self.downsample(x)
        out += residual
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, block_inplanes: tuple[int, ...] = (4, 8, 8, 16)) -> None:
        super().__init__()
        self.in_planes = block_inplanes[0]
        self.conv1 = nn.Conv3d(
            3, self.in_planes, kernel_size=(7, 7, 7), stride=(1, 2, 2), padding=(3, 3, 3),
            bias=False,
        )  # fmt: skip
        self.bn1 = nn.BatchNorm3d(self.in_planes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool3d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block_inplanes[0], 1)
        self.layer2 = self._make_layer(block_inplanes[1], 2)
        self.layer3 = self._make_layer(block_inplanes[2], 2)
        self.layer4 = self._make_layer(block_inplanes[3], 2)
        self.avgpool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.fc = nn.Linear(block_inplanes[3] * BasicBlock.expansion, CLASSES)
        for m in self.modules():
            if isinstance(m, nn.Conv3d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm3d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, stride: int) -> nn.Module:
        downsample = None
        if stride != 1 or self.in_planes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                nn.Conv3d(self.in_planes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm3d(planes),
            )
        layer = BasicBlock(self.in_planes, planes, stride, downsample)
        self.in_planes = planes * BasicBlock.expansion
        return nn.Sequential(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        return self.fc(x.view(x.size(0), -1))


def calculate_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        batch_size = targets.size(0)
        _, pred = outputs.topk(1, 1, largest=True, sorted=True)
        pred = pred.t()
        correct = pred.eq(targets.view(1, -1))
        n_correct_elems = correct.float().sum().item()
        return n_correct_elems / batch_size


def build() -> nn.Module:
    torch.manual_seed(0)
    return ResNet().double()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model), devices)


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(23)
    return [
        (
            torch.randn(BATCH, 3, 4, 16, 16, generator=gen, dtype=torch.float64),
            torch.randint(0, CLASSES, (BATCH,), generator=gen),
        )
        for _ in range(3)
    ]


def step(model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]) -> dict[str, Any]:
    (optimizer,) = opts
    inputs, targets = batch
    criterion = nn.CrossEntropyLoss()
    outputs = run(inputs)
    loss = criterion(outputs, targets)
    acc = calculate_accuracy(outputs, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"loss": loss.detach(), "acc": acc, "outputs": outputs.detach()}
