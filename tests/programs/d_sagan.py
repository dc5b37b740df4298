"""heykeetae's Self-Attention GAN: spectral norm whose power iteration writes ``u``, ``v``
through ``.data`` in forward, and a discriminator called twice before one backward.

Source: heykeetae/Self-Attention-GAN spectral.py

Ported: ``SpectralNorm`` as the script has it (``weight_u``, ``weight_v`` frozen parameters
and ``weight_bar`` made from the module's weight; each forward runs one power iteration that
assigns ``u.data`` and ``v.data``, then sets ``weight = w / sigma``), a two-layer
discriminator built of it, and trainer.py's discriminator step: ``D(real)`` then ``D(fake)``,
the hinge losses summed, one ``backward``, Adam(0.0, 0.9). Known to differ (issue 61's third
family): on one device the first call's backward reads the ``u``, ``v`` the second call wrote;
the replicas keep each call's own. The corpus keeps it to check that ``check=`` says so (and
says nothing once that family is made exact: ``test_programs``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import Parameter
from torch.nn import functional as F

import dataparallel as dp


def l2normalize(v: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    return v / (v.norm() + eps)


class SpectralNorm(nn.Module):
    def __init__(self, module: nn.Module, name: str = "weight", power_iterations: int = 1) -> None:
        super().__init__()
        self.module = module
        self.name = name
        self.power_iterations = power_iterations
        if not self._made_params():
            self._make_params()

    def _update_u_v(self) -> None:
        u = getattr(self.module, self.name + "_u")
        v = getattr(self.module, self.name + "_v")
        w = getattr(self.module, self.name + "_bar")
        height = w.data.shape[0]
        for _ in range(self.power_iterations):
            v.data = l2normalize(torch.mv(torch.t(w.view(height, -1).data), u.data))
            u.data = l2normalize(torch.mv(w.view(height, -1).data, v.data))
        sigma = u.dot(w.view(height, -1).mv(v))
        setattr(self.module, self.name, w / sigma.expand_as(w))

    def _made_params(self) -> bool:
        try:
            getattr(self.module, self.name + "_u")
            getattr(self.module, self.name + "_v")
            getattr(self.module, self.name + "_bar")
            return True
        except AttributeError:
            return False

    def _make_params(self) -> None:
        w = getattr(self.module, self.name)
        height = w.data.shape[0]
        width = w.view(height, -1).data.shape[1]
        u = Parameter(w.data.new(height).normal_(0, 1), requires_grad=False)
        v = Parameter(w.data.new(width).normal_(0, 1), requires_grad=False)
        u.data = l2normalize(u.data)
        v.data = l2normalize(v.data)
        w_bar = Parameter(w.data)
        del self.module._parameters[self.name]
        self.module.register_parameter(self.name + "_u", u)
        self.module.register_parameter(self.name + "_v", v)
        self.module.register_parameter(self.name + "_bar", w_bar)

    def forward(self, *args: Any) -> Any:
        self._update_u_v()
        return self.module.forward(*args)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Sequential(SpectralNorm(nn.Conv2d(3, 8, 4, 2, 1)), nn.LeakyReLU(0.1))
        self.last = SpectralNorm(nn.Conv2d(8, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.l1(x)).squeeze()


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.D = Discriminator()


def build() -> nn.Module:
    torch.manual_seed(0)
    return GAN()


def wrap(model: Any, devices: list[str]) -> Any:
    return dp.DataParallel(model.D, devices)


def plain(model: Any) -> Any:
    return model.D


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(model.D.parameters(), lr=4e-4, betas=(0.0, 0.9))]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 3, 8, 8, generator=gen), torch.randn(8, 3, 8, 8, generator=gen).tanh())
        for _ in range(2)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (d_optimizer,) = opts
    real_images, fake_images = batch
    d_optimizer.zero_grad()
    d_out_real = run(real_images)
    d_loss_real = F.relu(1.0 - d_out_real).mean()
    d_out_fake = run(fake_images)
    d_loss_fake = F.relu(1.0 + d_out_fake).mean()
    d_loss = d_loss_real + d_loss_fake
    d_loss.backward()
    d_optimizer.step()
    return {"d_loss": d_loss.detach()}
