"""PointNet classification with the feature-transform regulariser.

Source: fxia22/pointnet.pytorch pointnet/model.py

Ported: ``STNkd`` (a learned k x k transform, the identity added), ``PointNetfeat`` with the
input and feature transforms, the classifier returning ``(log_probs, trans, trans_feat)``,
and ``feature_transform_regularizer`` (``||I - A A^T||`` averaged over the batch), added to the
NLL loss with weight 0.001 as the training script does. The per-sample transforms come back
batched. BatchNorm layers are converted to ``nn.SyncBatchNorm`` in the port (the guide's way to
one device's statistics); dropout off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

POINTS, CLASSES = 12, 3


class STNkd(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv1d(k, 16, 1), nn.BatchNorm1d(16), nn.ReLU())
        self.fc = nn.Linear(16, k * k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max(self.conv(x), 2)[0]
        iden = torch.eye(self.k, device=x.device).flatten().unsqueeze(0)
        return (self.fc(x) + iden).view(-1, self.k, self.k)


class PointNetCls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stn = STNkd(3)
        self.conv1 = nn.Sequential(nn.Conv1d(3, 8, 1), nn.BatchNorm1d(8), nn.ReLU())
        self.fstn = STNkd(8)
        self.conv2 = nn.Sequential(nn.Conv1d(8, 16, 1), nn.BatchNorm1d(16))
        self.head = nn.Sequential(
            nn.Linear(16, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        trans = self.stn(x)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = self.conv1(x)
        trans_feat = self.fstn(x)
        x = torch.bmm(x.transpose(2, 1), trans_feat).transpose(2, 1)
        x = torch.max(self.conv2(x), 2)[0]
        return F.log_softmax(self.head(x), dim=1), trans, trans_feat


def feature_transform_regularizer(trans: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(trans.size(1), device=trans.device)[None, :, :]
    return torch.mean(torch.norm(torch.bmm(trans, trans.transpose(2, 1)) - eye, dim=(1, 2)))


def build() -> nn.Module:
    torch.manual_seed(0)
    return PointNetCls()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model), devices)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(29)
    return [
        (torch.randn(7, 3, POINTS, generator=gen), torch.randint(0, CLASSES, (7,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    points, target = batch
    pred, trans, trans_feat = run(points)
    loss = F.nll_loss(pred, target) + feature_transform_regularizer(trans_feat) * 0.001
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "pred": pred.detach(), "trans": trans.detach()}
