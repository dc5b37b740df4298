"""PyTorch's DCGAN example: a generator and a discriminator with BatchNorm, trained in turn.

Source: pytorch/examples dcgan/main.py

Ported: the generator (transposed convolutions, BatchNorm, ReLU, Tanh) and the discriminator
(convolutions, BatchNorm, LeakyReLU, Sigmoid) at 8 x 8, ``weights_init``, and the script's
step: the discriminator on a real batch (label 1) and a fake one (label 0, detached), then the
generator through the discriminator (label 1), with ``BCELoss`` and Adam(0.5, 0.999). The
script wraps each net in ``nn.DataParallel``; the port converts their BatchNorm layers to
``nn.SyncBatchNorm`` first (one device's statistics, the guide's way).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import dataparallel as dp

NZ, NGF, NDF = 4, 8, 8


def weights_init(m: nn.Module) -> None:
    if "Conv" in type(m).__name__:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif "BatchNorm" in type(m).__name__:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.netG = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, 3, 4, 2, 1, bias=False),
            nn.Tanh(),
        )
        self.netD = nn.Sequential(
            nn.Conv2d(3, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(NDF * 2, 1, 2, 1, 0, bias=False),
            nn.Sigmoid(),
        )  # fmt: skip
        self.apply(weights_init)


def build() -> nn.Module:
    torch.manual_seed(0)
    return GAN()


def wrap(model: Any, devices: list[str]) -> Any:
    sync = nn.SyncBatchNorm.convert_sync_batchnorm
    return SimpleNamespace(
        G=dp.DataParallel(sync(model.netG), devices), D=dp.DataParallel(sync(model.netD), devices)
    )


def plain(model: Any) -> Any:
    return SimpleNamespace(G=model.netG, D=model.netD)


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Adam(model.netD.parameters(), lr=2e-3, betas=(0.5, 0.999)),
        torch.optim.Adam(model.netG.parameters(), lr=2e-3, betas=(0.5, 0.999)),
    ]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(34)
    return [
        (torch.randn(6, 3, 8, 8, generator=gen).tanh(), torch.randn(6, NZ, 1, 1, generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    opt_d, opt_g = opts
    real, noise = batch
    criterion = nn.BCELoss()
    ones, zeros = torch.ones(real.shape[0]), torch.zeros(real.shape[0])
    opt_d.zero_grad()
    err_real = criterion(run.D(real).view(-1), ones)
    err_real.backward()
    fake = run.G(noise)
    err_fake = criterion(run.D(fake.detach()).view(-1), zeros)
    err_fake.backward()
    opt_d.step()
    opt_g.zero_grad()
    err_g = criterion(run.D(fake).view(-1), ones)
    err_g.backward()
    opt_g.step()
    return {
        "err_real": err_real.detach(),
        "err_fake": err_fake.detach(),
        "err_g": err_g.detach(),
        "fake": fake.detach(),
    }
