"""siamese-triplet: a network applied to three inputs in one call, the triplet margin loss.

Source: adambielski/siamese-triplet networks.py

Ported: ``EmbeddingNet`` (a small convolutional embedding), ``TripletNet`` (its forward takes
the anchor, positive and negative batches and returns the three embeddings), and the
``TripletLoss`` of ``losses.py`` (``relu(d(a, p) - d(a, n) + margin)``, averaged), computed on
the gathered embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class EmbeddingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convnet = nn.Sequential(nn.Conv2d(1, 4, 3), nn.PReLU(), nn.MaxPool2d(2))
        self.fc = nn.Sequential(nn.Linear(4 * 3 * 3, 8), nn.PReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convnet(x).flatten(1))


class TripletNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding_net = EmbeddingNet()

    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return self.embedding_net(x1), self.embedding_net(x2), self.embedding_net(x3)


def triplet_loss(
    anchor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    distance_positive = (anchor - positive).pow(2).sum(1)
    distance_negative = (anchor - negative).pow(2).sum(1)
    return F.relu(distance_positive - distance_negative + 1.0).mean()


def build() -> nn.Module:
    torch.manual_seed(0)
    return TripletNet()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(32)
    return [tuple(torch.randn(6, 1, 8, 8, generator=gen) for _ in range(3)) for _ in range(3)]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    embeddings = run(*batch)
    loss = triplet_loss(*embeddings)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "anchor": embeddings[0].detach()}
