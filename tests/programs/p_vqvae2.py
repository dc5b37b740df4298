"""VQ-VAE-2: a vector-quantised autoencoder whose latent loss is returned with shape ``(1,)``.

Source: rosinality/vq-vae-2-pytorch vqvae.py

Ported: the encoder, the nearest-codebook quantisation with the straight-through estimator,
the commitment term ``(quantize.detach() - input).pow(2).mean()`` returned as
``diff.unsqueeze(0)`` (the torch-era idiom for DataParallel's vector of losses), the decoder,
and the script's step: ``latent_loss.mean()`` added to the reconstruction MSE with weight
0.25. Left out: the codebook's EMA update (buffers written in forward keep replica 0's chunk,
the guide's rule): the codebook is a parameter trained by the codebook loss instead, as in
the first VQ-VAE; the two-level hierarchy is one level here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

DIM, CODES = 4, 6


class Quantize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(DIM, CODES))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flatten = x.reshape(-1, DIM)
        dist = (
            flatten.pow(2).sum(1, keepdim=True)
            - 2 * flatten @ self.embed
            + self.embed.pow(2).sum(0, keepdim=True)
        )
        index = dist.argmin(1).view(*x.shape[:-1])
        quantize = F.embedding(index, self.embed.t())
        diff = (quantize.detach() - x).pow(2).mean() + (quantize - x.detach()).pow(2).mean()
        quantize = x + (quantize - x).detach()
        return quantize, diff


class VQVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, DIM, 1))
        self.quantize = Quantize()
        self.dec = nn.Sequential(nn.Conv2d(DIM, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))

    def forward(self, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.enc(img).permute(0, 2, 3, 1)
        quant, diff = self.quantize(z)
        dec = self.dec(quant.permute(0, 3, 1, 2))
        return dec, diff.unsqueeze(0)


def build() -> nn.Module:
    torch.manual_seed(0)
    return VQVAE()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(5, 1, 6, 6, generator=gen) for _ in range(3)]  # 5: uneven chunks


def step(
    model: Any, run: Any, img: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    out, latent_loss = run(img)
    recon_loss = F.mse_loss(out, img)
    latent_loss = latent_loss.mean()
    loss = recon_loss + 0.25 * latent_loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"recon": recon_loss.detach(), "latent": latent_loss.detach(), "out": out.detach()}
