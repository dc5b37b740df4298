"""CLIP fine-tuning: an image and a text tower, and the symmetric contrastive loss over every
pair of the batch.

Source: openai/CLIP clip/model.py

Ported: both encoders (small MLPs), the normalised embeddings, the learned temperature
``logit_scale.exp()``, and the fine-tuning step: cross-entropy of the image-to-text and
text-to-image logits against ``arange(batch)``, averaged. One change, the port the guide
names: the script's forward returns ``logit_scale * image @ text.t()``, a matrix over the
chunk's own samples, which no gather makes the batch's (uneven chunks are refused, with this
port in the message: ``test_programs``); here forward returns the embeddings and the scale,
and the step takes the product on the gathered ones, one device's logits.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class CLIP(nn.Module):
    def __init__(self, logits_inside: bool = False) -> None:
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Embedding(30, 16), nn.Flatten(), nn.Linear(16 * 4, 8))
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
        self.logits_inside = logits_inside

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> Any:
        image_features = F.normalize(self.visual(image), dim=1)
        text_features = F.normalize(self.text(text), dim=1)
        scale = self.logit_scale.exp()
        if self.logits_inside:  # the script's own forward
            return scale * image_features @ text_features.t()
        return image_features, text_features, scale


def build() -> nn.Module:
    torch.manual_seed(0)
    return CLIP()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(9)
    return [
        (torch.randn(7, 12, generator=gen), torch.randint(0, 30, (7, 4), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    image_features, text_features, scale = run(*batch)
    logits = scale * image_features @ text_features.t()
    truth = torch.arange(logits.shape[0])
    loss = (F.cross_entropy(logits, truth) + F.cross_entropy(logits.t(), truth)) / 2
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "logits": logits.detach()}
