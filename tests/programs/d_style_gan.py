"""rosinality's style-based GAN: a discriminator that takes the minibatch standard deviation.

Source: rosinality/style-based-gan-pytorch model.py

Ported: the discriminator's last block (``out.var(0)`` over the batch, its square root
averaged and appended as a feature map, as the script's ``Discriminator.forward`` does before
its final convolutions) at 4 x 4, a small generator from a latent vector, and the script's
WGAN-GP discriminator step without the penalty (``-real.mean()`` and ``fake.mean()``, Adam
(0.0, 0.99)). Known to differ: each replica takes the standard deviation over its own chunk
(torch's DataParallel does the same), so the output is not one device's. The corpus keeps it to
check that ``check=`` says so (``test_programs``); it is not in the exact list.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import dataparallel as dp

LATENT, CH = 6, 4


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.progression = nn.Sequential(nn.Conv2d(3, CH, 3, padding=1), nn.LeakyReLU(0.2))
        self.final = nn.Sequential(
            nn.Conv2d(CH + 1, CH, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(CH, CH, 4)
        )
        self.linear = nn.Linear(CH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.progression(x)
        out_std = torch.sqrt(out.var(0, unbiased=False) + 1e-8)
        mean_std = out_std.mean().expand(out.size(0), 1, 4, 4)
        out = torch.cat([out, mean_std], 1)
        out = self.final(out).squeeze(2).squeeze(2)
        return self.linear(out)


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(LATENT, 3 * 16), nn.Tanh())
        self.discriminator = Discriminator()


def build() -> nn.Module:
    torch.manual_seed(0)
    return GAN()


def wrap(model: Any, devices: list[str]) -> Any:
    return SimpleNamespace(G=model.generator, D=dp.DataParallel(model.discriminator, devices))


def plain(model: Any) -> Any:
    return SimpleNamespace(G=model.generator, D=model.discriminator)


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(model.discriminator.parameters(), lr=1e-3, betas=(0.0, 0.99))]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(8, 3, 4, 4, generator=gen), torch.randn(8, LATENT, generator=gen))
        for _ in range(2)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt_d,) = opts
    real, z = batch
    opt_d.zero_grad()
    real_predict = run.D(real).mean()
    fake = run.G(z).view(-1, 3, 4, 4).detach()
    fake_predict = run.D(fake).mean()
    loss = fake_predict - real_predict
    loss.backward()
    opt_d.step()
    return {"loss": loss.detach()}
