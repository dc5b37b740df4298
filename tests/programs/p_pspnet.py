"""hszhao's semseg PSPNet: a pyramid pooling head whose losses, main and auxiliary, are taken
inside forward over the pixels that are not ignored.

Source: hszhao/semseg tool/train.py

Ported: model/pspnet.py's ``PPM`` (adaptive average pooling to bins 1, 2, 3 and 6, a 1 x 1
conv, BatchNorm and ReLU each, upsampled bilinearly with ``align_corners=True`` and
concatenated) and ``PSPNet`` (a small dilated backbone in place of the ResNet, the ``cls``
head, the ``aux`` head on the third stage, the output upsampled to the input size; in
training it returns ``x.max(1)[1]``, ``main_loss`` and ``aux_loss`` from
``CrossEntropyLoss(ignore_index=255)``), and train.py's step: ``torch.mean`` of both losses
(the script's way for ``nn.DataParallel``), ``loss = main_loss + aux_weight * aux_loss``,
SGD with momentum. Each loss is a mean over its chunk's labelled pixels, so the port gives
the wrapper that count as ``scalar_weights``; BatchNorm is converted to ``nn.SyncBatchNorm``
(one device's statistics, the guide's way).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

CLASSES, BATCH, SIZE = 4, 6, 17  # the script's crops are 8k + 1 (zoom_factor 8)


class PPM(nn.Module):
    def __init__(self, in_dim: int, reduction_dim: int, bins: tuple[int, ...]) -> None:
        super().__init__()
        self.features = nn.ModuleList(
            [
                nn.Sequential(
                    nn.AdaptiveAvgPool2d(bin),
                    nn.Conv2d(in_dim, reduction_dim, kernel_size=1, bias=False),
                    nn.BatchNorm2d(reduction_dim),
                    nn.ReLU(inplace=True),
                )
                for bin in bins
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_size = x.size()
        out = [x]
        for f in self.features:
            out.append(F.interpolate(f(x), x_size[2:], mode="bilinear", align_corners=True))
        return torch.cat(out, 1)


def _stage(cin: int, cout: int, stride: int, dilation: int = 1) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, padding=dilation, dilation=dilation, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class PSPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss(ignore_index=255)
        self.layer0 = _stage(3, 8, 2)
        self.layer1, self.layer2 = _stage(8, 8, 1), _stage(8, 16, 2)
        self.layer3, self.layer4 = _stage(16, 16, 1, 2), _stage(16, 32, 1, 4)
        self.ppm = PPM(32, 8, (1, 2, 3, 6))
        self.cls = nn.Sequential(
            nn.Conv2d(64, 16, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Dropout2d(p=0.0),
            nn.Conv2d(16, CLASSES, kernel_size=1),
        )
        self.aux = nn.Sequential(
            nn.Conv2d(16, 8, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Dropout2d(p=0.0),
            nn.Conv2d(8, CLASSES, kernel_size=1),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        x_size = x.size()
        h, w = x_size[2], x_size[3]
        x = self.layer0(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x_tmp = self.layer3(x)
        x = self.layer4(x_tmp)
        x = self.cls(self.ppm(x))
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=True)
        if self.training and y is not None:
            aux = self.aux(x_tmp)
            aux = F.interpolate(aux, size=(h, w), mode="bilinear", align_corners=True)
            main_loss = self.criterion(x, y)
            aux_loss = self.criterion(aux, y)
            return x.max(1)[1], main_loss, aux_loss
        return x


def build() -> nn.Module:
    torch.manual_seed(0)
    return PSPNet()


def _labelled(args: Any, kwargs: Any) -> Any:
    """Each chunk's count of the pixels its losses average over."""
    return (args[1] != 255).sum() if len(args) > 1 else 1


def wrap(model: nn.Module, devices: list[str]) -> Any:
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return dp.DataParallel(sync, devices, scalar_weights=_labelled)


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(17)
    out = []
    for _ in range(3):
        image = torch.randn(BATCH, 3, SIZE, SIZE, generator=gen)
        target = torch.randint(0, CLASSES, (BATCH, SIZE, SIZE), generator=gen)
        ignored = (
            torch.rand(BATCH, SIZE, SIZE, generator=gen)
            < torch.linspace(0, 0.6, BATCH)[:, None, None]
        )
        out.append((image, target.masked_fill(ignored, 255)))
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (optimizer,) = opts
    input, target = batch
    output, main_loss, aux_loss = run(input, target)
    main_loss, aux_loss = torch.mean(main_loss), torch.mean(aux_loss)
    loss = main_loss + 0.4 * aux_loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"output": output, "main_loss": main_loss.detach(), "aux_loss": aux_loss.detach()}
