"""DGCNN: edge convolutions over each point cloud's k nearest neighbours, found in forward.

Source: WangYueFt/dgcnn pytorch/model.py

Ported: ``knn`` (pairwise distances within each cloud, ``topk``), ``get_graph_feature`` (the
neighbours' features gathered with per-cloud index offsets over the flattened batch, the edge
feature ``(x_j - x_i, x_i)``), two EdgeConv blocks with max over the neighbours, global max and
mean pooling, and the classifier; the script's step with label-smoothed cross-entropy. Its
BatchNorm layers are left out (per-chunk statistics, the guide's rule); dropout is off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

K, POINTS, CLASSES = 4, 10, 3


def knn(x: torch.Tensor, k: int) -> torch.Tensor:
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = torch.sum(x**2, dim=1, keepdim=True)
    pairwise = -xx - inner - xx.transpose(2, 1)
    return pairwise.topk(k=k, dim=-1)[1]


def get_graph_feature(x: torch.Tensor, k: int = K) -> torch.Tensor:
    batch, dims, points = x.shape
    idx = knn(x, k)
    offsets = torch.arange(0, batch, device=x.device).view(-1, 1, 1) * points
    idx = (idx + offsets).view(-1)  # indices into the flattened batch: the chunk's own
    x = x.transpose(2, 1).contiguous()
    feature = x.view(batch * points, -1)[idx, :].view(batch, points, k, dims)
    x = x.view(batch, points, 1, dims).repeat(1, 1, k, 1)
    return torch.cat((feature - x, x), dim=3).permute(0, 3, 1, 2)


class DGCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(6, 8, 1, bias=False), nn.LeakyReLU(0.2))
        self.conv2 = nn.Sequential(nn.Conv2d(16, 8, 1, bias=False), nn.LeakyReLU(0.2))
        self.conv5 = nn.Sequential(nn.Conv1d(16, 12, 1, bias=False), nn.LeakyReLU(0.2))
        self.linear = nn.Linear(24, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.conv1(get_graph_feature(x)).max(dim=-1)[0]
        x2 = self.conv2(get_graph_feature(x1)).max(dim=-1)[0]
        x = self.conv5(torch.cat((x1, x2), dim=1))
        pooled = torch.cat((F.adaptive_max_pool1d(x, 1), F.adaptive_avg_pool1d(x, 1)), 1)
        return self.linear(pooled.flatten(1))


def build() -> nn.Module:
    torch.manual_seed(0)
    return DGCNN()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(5, 3, POINTS, generator=gen), torch.randint(0, CLASSES, (5,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    points, label = batch
    logits = run(points)
    loss = F.cross_entropy(logits, label, label_smoothing=0.2)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "logits": logits.detach()}
