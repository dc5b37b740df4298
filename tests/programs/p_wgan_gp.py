"""WGAN-GP on a toy distribution: a critic's gradient penalty, differentiated twice.

Source: caogang/wgan-gp gan_toy.py

Ported: the generator and critic (MLPs), the script's alternation (critic steps, then a
generator step), and ``calc_gradient_penalty``: interpolates between real and fake samples,
``autograd.grad`` of the critic's output with ``create_graph=True``, and the penalty
``((grad.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA``, backpropagated through the gradient (a
double backward through the wrapper's scatter and gather). Generator and critic are each
wrapped, as the script wraps each in ``nn.DataParallel``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import autograd, nn

import dataparallel as dp

LAMBDA, DIM, NOISE = 0.1, 16, 2


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(NOISE, DIM), nn.ReLU(), nn.Linear(DIM, 2))
        self.D = nn.Sequential(nn.Linear(2, DIM), nn.ReLU(), nn.Linear(DIM, 1))


def build() -> nn.Module:
    torch.manual_seed(0)
    return GAN()


def wrap(model: Any, devices: list[str]) -> Any:
    return SimpleNamespace(G=dp.DataParallel(model.G, devices), D=dp.DataParallel(model.D, devices))


def plain(model: Any) -> Any:
    return SimpleNamespace(G=model.G, D=model.D)


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Adam(model.G.parameters(), lr=1e-3, betas=(0.5, 0.9)),
        torch.optim.Adam(model.D.parameters(), lr=1e-3, betas=(0.5, 0.9)),
    ]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(4)
    return [
        (torch.randn(7, 2, generator=gen), torch.randn(7, NOISE, generator=gen)) for _ in range(3)
    ]


def _penalty(critic: Any, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    alpha = torch.rand(real.shape[0], 1).expand(real.size())
    interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    disc = critic(interpolates)
    grads = autograd.grad(
        disc, interpolates, grad_outputs=torch.ones_like(disc), create_graph=True
    )[0]
    return ((grads.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    opt_g, opt_d = opts
    real, noise = batch
    for p in model.D.parameters():
        p.requires_grad_(True)
    fake = run.G(noise).detach()
    gp = _penalty(run.D, real, fake)
    d_cost = run.D(fake).mean() - run.D(real).mean() + gp
    opt_d.zero_grad()
    d_cost.backward()
    opt_d.step()
    for p in model.D.parameters():
        p.requires_grad_(False)  # the script freezes the critic for the generator's step
    g_cost = -run.D(run.G(noise)).mean()
    opt_g.zero_grad()
    g_cost.backward()
    opt_g.step()
    for p in model.D.parameters():
        p.requires_grad_(True)
    return {"d_cost": d_cost.detach(), "gp": gp.detach(), "g_cost": g_cost.detach()}
