"""Pytorch-UNet: a U-Net for segmentation trained with cross-entropy plus the Dice loss.

Source: milesial/Pytorch-UNet train.py

Ported: the U-Net's blocks (``DoubleConv``: two conv-BatchNorm-ReLU; ``Down``: max pooling and
a double conv; ``Up``: bilinear upsampling, the skip connection concatenated, a double conv;
the 1x1 output conv), and the training step: ``CrossEntropyLoss`` plus ``dice_loss`` of the
softmax against the one-hot masks (a mean over the batch), with gradient clipping. Two levels,
8 x 8 images; BatchNorm converted to ``nn.SyncBatchNorm`` in the port (the guide's way to one
device's statistics).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

CLASSES = 3


class DoubleConv(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.double_conv = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
            nn.BatchNorm2d(outputs),
            nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, padding=1, bias=False),
            nn.BatchNorm2d(outputs),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.double_conv(x)


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inc = DoubleConv(3, 4)
        self.down = nn.Sequential(nn.MaxPool2d(2), DoubleConv(4, 8))
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv = DoubleConv(12, 4)
        self.outc = nn.Conv2d(4, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down(x1)
        return self.outc(self.conv(torch.cat([x1, self.up(x2)], dim=1)))


def dice_coeff(input: torch.Tensor, target: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    inter = 2 * (input * target).sum(dim=(-1, -2))
    sets_sum = input.sum(dim=(-1, -2)) + target.sum(dim=(-1, -2))
    sets_sum = torch.where(sets_sum == 0, inter, sets_sum)
    return ((inter + epsilon) / (sets_sum + epsilon)).mean()


def build() -> nn.Module:
    torch.manual_seed(0)
    return UNet()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model), devices)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(35)
    return [
        (
            torch.randn(5, 3, 8, 8, generator=gen),
            torch.randint(0, CLASSES, (5, 8, 8), generator=gen),
        )
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    images, true_masks = batch
    masks_pred = run(images)
    one_hot = F.one_hot(true_masks, CLASSES).permute(0, 3, 1, 2).float()
    dice = 1 - dice_coeff(F.softmax(masks_pred, dim=1).flatten(0, 1), one_hot.flatten(0, 1))
    loss = F.cross_entropy(masks_pred, true_masks) + dice
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {"loss": loss.detach(), "masks_pred": masks_pred.detach()}
