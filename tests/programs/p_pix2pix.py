"""pix2pix: a conditional GAN, the discriminator judging (input, output) pairs, the generator
trained with the GAN loss plus L1.

Source: junyanz/pytorch-CycleGAN-and-pix2pix models/pix2pix_model.py

Ported: ``backward_D`` (the fake pair ``cat(real_A, fake_B)`` detached and the real pair
``cat(real_A, real_B)``, each through the discriminator, the mean of the two GAN losses over
2) and ``backward_G`` (the GAN loss of the fake pair against "real" plus ``lambda_L1 *
L1(fake_B, real_B)``), ``set_requires_grad(netD, False)`` around the generator's step, the
LSGAN loss (``MSELoss`` against targets of the prediction's shape), and the two nets (a tiny
encoder-decoder and a PatchGAN), each wrapped as the repository's ``init_net`` wraps them in
``DataParallel``. Normalisation is instance norm (per sample), as the repository allows; the
convolution before it has no bias (its gradient is zero in exact arithmetic, and Adam turns
that rounding noise into updates of the learning rate's size on either run).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import dataparallel as dp

LAMBDA_L1 = 100.0


class Pix2Pix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.netG = nn.Sequential(
            nn.Conv2d(3, 8, 4, 2, 1, bias=False),
            nn.InstanceNorm2d(8),
            nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(8, 3, 4, 2, 1),
            nn.Tanh(),
        )
        self.netD = nn.Sequential(
            nn.Conv2d(6, 8, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(8, 1, 3, 1, 1)
        )


def build() -> nn.Module:
    torch.manual_seed(0)
    return Pix2Pix()


def wrap(model: Any, devices: list[str]) -> Any:
    return SimpleNamespace(
        G=dp.DataParallel(model.netG, devices), D=dp.DataParallel(model.netD, devices)
    )


def plain(model: Any) -> Any:
    return SimpleNamespace(G=model.netG, D=model.netD)


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Adam(model.netG.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        torch.optim.Adam(model.netD.parameters(), lr=2e-4, betas=(0.5, 0.999)),
    ]


def _gan_loss(prediction: torch.Tensor, real: bool) -> torch.Tensor:
    target = torch.ones_like(prediction) if real else torch.zeros_like(prediction)
    return nn.functional.mse_loss(prediction, target)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(37)
    return [
        (torch.randn(5, 3, 8, 8, generator=gen), torch.randn(5, 3, 8, 8, generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    opt_g, opt_d = opts
    real_a, real_b = batch
    fake_b = run.G(real_a)
    for p in model.netD.parameters():
        p.requires_grad = True
    opt_d.zero_grad()
    loss_d_fake = _gan_loss(run.D(torch.cat((real_a, fake_b), 1).detach()), False)
    loss_d_real = _gan_loss(run.D(torch.cat((real_a, real_b), 1)), True)
    loss_d = (loss_d_fake + loss_d_real) * 0.5
    loss_d.backward()
    opt_d.step()
    for p in model.netD.parameters():
        p.requires_grad = False
    opt_g.zero_grad()
    loss_g_gan = _gan_loss(run.D(torch.cat((real_a, fake_b), 1)), True)
    loss_g = loss_g_gan + nn.functional.l1_loss(fake_b, real_b) * LAMBDA_L1
    loss_g.backward()
    opt_g.step()
    for p in model.netD.parameters():
        p.requires_grad = True
    return {"loss_d": loss_d.detach(), "loss_g": loss_g.detach(), "fake_b": fake_b.detach()}
