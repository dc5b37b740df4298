"""SimCLR: two augmented views per image, a projection head, the NT-Xent loss over the batch.

Source: sthalles/SimCLR simclr.py

Ported: the encoder and projection head (an MLP here), the two views concatenated into one
batch of ``2N`` as the script feeds them, and ``info_nce_loss``: the similarity of every pair
of the ``2N`` features, the self-similarity masked out, each view's positive put first, the
logits over the temperature and cross-entropy against 0. The loss needs every pair of the
batch, so it is computed on the gathered features, as the script computes it outside the
model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

TEMPERATURE, VIEWS = 0.5, 2


class SimCLRNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.ReLU())
        self.projection = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.backbone(x))


def info_nce_loss(features: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.cat([torch.arange(batch_size) for _ in range(VIEWS)], dim=0)
    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
    features = F.normalize(features, dim=1)
    similarity = features @ features.T
    mask = torch.eye(labels.shape[0], dtype=torch.bool)
    labels = labels[~mask].view(labels.shape[0], -1)
    similarity = similarity[~mask].view(similarity.shape[0], -1)
    positives = similarity[labels.bool()].view(labels.shape[0], -1)
    negatives = similarity[~labels.bool()].view(similarity.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1) / TEMPERATURE
    return logits, torch.zeros(logits.shape[0], dtype=torch.long)


def build() -> nn.Module:
    torch.manual_seed(0)
    return SimCLRNet()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(30)
    out = []
    for _ in range(3):
        images = torch.randn(5, 10, generator=gen)
        views = [images + 0.1 * torch.randn(5, 10, generator=gen) for _ in range(VIEWS)]
        out.append(torch.cat(views, dim=0))
    return out


def step(
    model: Any, run: Any, images: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    features = run(images)
    logits, labels = info_nce_loss(features, images.shape[0] // VIEWS)
    loss = F.cross_entropy(logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "features": features.detach()}
