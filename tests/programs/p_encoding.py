"""PyTorch-Encoding's parallel layer: a model whose outputs stay on their devices, and a
criterion that runs on each device and reduces once.

Source: zhanghang1989/PyTorch-Encoding encoding/parallel.py

Ported: ``DataParallelModel``, a DataParallel subclass whose ``gather`` returns the
per-device outputs (so the loss is computed next to each output), and
``DataParallelCriterion``, which scatters the targets, applies the criterion on each device
and reduces: here ``dp.DataParallelCriterion``, which takes the per-device outputs and makes
torch's mean-reduced cross-entropy exact (one division by the global count). A segmentation
head (per-pixel classes) with ``ignore_index`` pixels, as the library's segmentation scripts
train.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import dataparallel as dp

CLASSES = 4


class DataParallelModel(dp.DataParallel):
    """The library's pattern: an overridden gather that leaves the outputs on their devices
    (ported: as ``dp.DeviceOutputs``, the list that also says where each output is and how
    many samples it holds, which ``dp.DataParallelCriterion`` reads)."""

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        return dp.DeviceOutputs(outputs, [o.device for o in outputs], [len(o) for o in outputs])


class SegHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(8, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build() -> nn.Module:
    torch.manual_seed(0)
    return SegHead()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return (DataParallelModel(model, devices), dp.DataParallelCriterion(_criterion(), devices))


def plain(model: nn.Module) -> Any:
    return (model, None)


def _criterion() -> nn.Module:
    return nn.CrossEntropyLoss(ignore_index=-1)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(6)
    out = []
    for _ in range(3):
        target = torch.randint(0, CLASSES, (5, 6, 6), generator=gen)
        target[:2, :3] = -1  # unlabelled pixels, more of them in the first chunk
        out.append((torch.randn(5, 3, 6, 6, generator=gen), target))
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    x, target = batch
    net, criterion = run
    if criterion is None:  # one device: the plain model and criterion
        loss = _criterion()(net(x), target)
    else:
        outputs = net(x)
        assert isinstance(outputs, dp.DeviceOutputs) and len(outputs) > 1
        loss = criterion(outputs, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach()}
