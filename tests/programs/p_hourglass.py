"""princeton-vl's stacked hourglass: heatmaps from stacked hourglasses, the loss inside the
wrapped module, one per sample and stack.

Source: princeton-vl/pytorch_stacked_hourglass task/pose.py

Ported: models/layers.py's ``Conv``, ``Residual`` (pre-activation BatchNorm, a 1-3-1
bottleneck, a skip ``Conv`` where the widths differ) and ``Hourglass`` (recursive, pooled
and upsampled), models/posenet.py's ``PoseNet`` (``imgs.permute(0, 3, 1, 2)``, the stem, the
stacks joined by ``merge_preds`` and ``merge_features``, ``torch.stack`` of the stacks'
heatmaps) with ``calc_loss`` and ``HeatmapLoss`` (squared error averaged per sample), and
task/pose.py's ``Trainer`` (the module the script wraps: the model, then its loss on the
labels passed as keywords, returned as a list after the predictions), with Adam. At 32 x 32,
two stacks of depth 2, narrow, in float64: some thirty BatchNorm layers over small maps carry
float32 rounding past the harness's 1e-5 (4.7e-5 on the heatmaps; 1e-13 in float64). The
port converts BatchNorm to ``nn.SyncBatchNorm`` (one device's statistics, the guide's way).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dataparallel as dp

INP, OUP, NSTACK, BATCH = 8, 3, 2, 6


class Conv(nn.Module):
    def __init__(
        self, inp_dim: int, out_dim: int, kernel_size: int = 3, stride: int = 1,
        bn: bool = False, relu: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.inp_dim = inp_dim
        pad = (kernel_size - 1) // 2
        self.conv = nn.Conv2d(inp_dim, out_dim, kernel_size, stride, padding=pad, bias=True)
        self.relu = nn.ReLU() if relu else None
        self.bn = nn.BatchNorm2d(out_dim) if bn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.size()[1] == self.inp_dim, f"{x.size()[1]} {self.inp_dim}"
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        if self.relu is not None:
            x = self.relu(x)
        return x


class Residual(nn.Module):
    def __init__(self, inp_dim: int, out_dim: int) -> None:
        super().__init__()
        half = int(out_dim / 2)
        self.relu = nn.ReLU()
        self.bn1 = nn.BatchNorm2d(inp_dim)
        self.conv1 = Conv(inp_dim, half, 1, relu=False)
        self.bn2 = nn.BatchNorm2d(half)
        self.conv2 = Conv(half, half, 3, relu=False)
        self.bn3 = nn.BatchNorm2d(half)
        self.conv3 = Conv(half, out_dim, 1, relu=False)
        self.skip_layer = Conv(inp_dim, out_dim, 1, relu=False)
        self.need_skip = inp_dim != out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.skip_layer(x) if self.need_skip else x
        out = self.conv1(self.relu(self.bn1(x)))
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        out += residual
        return out


class Hourglass(nn.Module):
    def __init__(self, n: int, f: int) -> None:
        super().__init__()
        self.up1 = Residual(f, f)
        self.pool1 = nn.MaxPool2d(2, 2)
        self.low1 = Residual(f, f)
        self.n = n
        self.low2: nn.Module = Hourglass(n - 1, f) if n > 1 else Residual(f, f)
        self.low3 = Residual(f, f)
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up1 = self.up1(x)
        low3 = self.low3(self.low2(self.low1(self.pool1(x))))
        return up1 + self.up2(low3)


class HeatmapLoss(nn.Module):
    def forward(self, pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
        loss = (pred - gt) ** 2
        return loss.mean(dim=3).mean(dim=2).mean(dim=1)


class PoseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nstack = NSTACK
        self.pre = nn.Sequential(
            Conv(3, 8, 7, 2, bn=True, relu=True), Residual(8, 16), nn.MaxPool2d(2, 2),
            Residual(16, 16), Residual(16, INP),
        )  # fmt: skip
        self.hgs = nn.ModuleList([nn.Sequential(Hourglass(2, INP)) for _ in range(NSTACK)])
        self.features = nn.ModuleList(
            [
                nn.Sequential(Residual(INP, INP), Conv(INP, INP, 1, bn=True, relu=True))
                for _ in range(NSTACK)
            ]
        )
        self.outs = nn.ModuleList([Conv(INP, OUP, 1, relu=False, bn=False) for _ in range(NSTACK)])
        self.merge_features = nn.ModuleList(
            [Conv(INP, INP, 1, relu=False, bn=False) for _ in range(NSTACK - 1)]
        )
        self.merge_preds = nn.ModuleList(
            [Conv(OUP, INP, 1, relu=False, bn=False) for _ in range(NSTACK - 1)]
        )
        self.heatmapLoss = HeatmapLoss()

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        x = self.pre(imgs.permute(0, 3, 1, 2))
        combined_hm_preds = []
        for i in range(self.nstack):
            feature = self.features[i](self.hgs[i](x))
            preds = self.outs[i](feature)
            combined_hm_preds.append(preds)
            if i < self.nstack - 1:
                x = x + self.merge_preds[i](preds) + self.merge_features[i](feature)
        return torch.stack(combined_hm_preds, 1)

    def calc_loss(self, combined_hm_preds: Any, heatmaps: torch.Tensor) -> torch.Tensor:
        combined_loss = [
            self.heatmapLoss(combined_hm_preds[0][:, i], heatmaps) for i in range(self.nstack)
        ]
        return torch.stack(combined_loss, dim=1)


class Trainer(nn.Module):
    def __init__(self, model: PoseNet, inference_keys: list[str]) -> None:
        super().__init__()
        self.model = model
        self.keys = inference_keys
        self.calc_loss = model.calc_loss

    def forward(self, imgs: torch.Tensor, **inputs: Any) -> Any:
        inps, labels = {}, {}
        for i in inputs:
            if i in self.keys:
                inps[i] = inputs[i]
            else:
                labels[i] = inputs[i]
        if not self.training:
            return self.model(imgs, **inps)
        combined_hm_preds = self.model(imgs, **inps)
        if type(combined_hm_preds) is not list and type(combined_hm_preds) is not tuple:
            combined_hm_preds = [combined_hm_preds]
        loss = self.calc_loss(**labels, combined_hm_preds=combined_hm_preds)
        return [*combined_hm_preds, loss]


def build() -> nn.Module:
    torch.manual_seed(0)
    return Trainer(PoseNet(), []).double()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model), devices)


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(model.parameters(), lr=1e-3)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(13)
    return [
        (
            torch.rand(BATCH, 32, 32, 3, generator=gen, dtype=torch.float64),
            torch.rand(BATCH, OUP, 8, 8, generator=gen, dtype=torch.float64),
        )
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (optimizer,) = opts
    imgs, heatmaps = batch
    result = run(imgs, heatmaps=heatmaps)
    combined_loss = result[-1]
    loss = torch.sum(combined_loss.mean(dim=0))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"loss": loss.detach(), "preds": result[0].detach()}
