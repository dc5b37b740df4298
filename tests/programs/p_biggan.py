"""ajbrock's BigGAN: G and D run together inside the wrapper, fed by self-sampling latents.

Source: ajbrock/BigGAN-PyTorch train_fns.py

Ported: utils.py's ``Distribution`` (a ``torch.Tensor`` subclass that samples itself in place,
``normal`` or ``categorical``, with a ``to`` that reads its own attributes) and ``prepare_z_y``
(``z_`` and ``y_`` made once, moved with that ``to``); model.py's ``G_D`` (G on ``z`` and its
shared class embedding, ``torch.cat`` of the fakes and the reals into one D call, the scores
split back with ``torch.split``); a tiny conditional G and a projection D; and
``GAN_training_function``: ``z_.sample_()`` and ``y_.sample_()`` each step, the hinge losses
(``loss_hinge_dis``, ``loss_hinge_gen``), D then G with Adam(0.0, 0.999). The script wraps
``G_D`` in ``nn.DataParallel``; here ``dp.DataParallel``, which splits ``z_`` and ``y_``
without calling their ``to``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

DIM_Z, N_CLASSES, SHARED, BATCH = 6, 3, 4, 6


class Distribution(torch.Tensor):
    def init_distribution(self, dist_type: str, **kwargs: Any) -> None:
        self.dist_type = dist_type
        self.dist_kwargs = kwargs
        if self.dist_type == "normal":
            self.mean, self.var = kwargs["mean"], kwargs["var"]
        elif self.dist_type == "categorical":
            self.num_categories = kwargs["num_categories"]

    def sample_(self) -> None:
        if self.dist_type == "normal":
            self.normal_(self.mean, self.var)
        elif self.dist_type == "categorical":
            self.random_(0, self.num_categories)

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        new_obj = Distribution(self)
        new_obj.init_distribution(self.dist_type, **self.dist_kwargs)
        new_obj.data = super().to(*args, **kwargs)
        return new_obj


def prepare_z_y(batch_size: int, device: str = "cpu") -> tuple[Any, Any]:
    z_ = Distribution(torch.randn(batch_size, DIM_Z, requires_grad=False))
    z_.init_distribution("normal", mean=0, var=1.0)
    z_ = z_.to(device, torch.float32)
    y_ = Distribution(torch.zeros(batch_size, requires_grad=False))
    y_.init_distribution("categorical", num_categories=N_CLASSES)
    y_ = y_.to(device, torch.int64)
    return z_, y_


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(N_CLASSES, SHARED)
        self.linear = nn.Linear(DIM_Z + SHARED, 3 * 4 * 4)

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(torch.cat([z, y], 1))).view(-1, 3, 4, 4)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.linear = nn.Linear(8, 1)
        self.embed = nn.Embedding(N_CLASSES, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.sum(F.relu(self.conv(x)), [2, 3])
        out = self.linear(h)
        return out + torch.sum(self.embed(y) * h, 1, keepdim=True)


class G_D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G, self.D = Generator(), Discriminator()

    def forward(
        self,
        z: torch.Tensor,
        gy: torch.Tensor,
        x: torch.Tensor | None = None,
        dy: torch.Tensor | None = None,
        train_G: bool = False,
    ) -> Any:
        with torch.set_grad_enabled(train_G):
            G_z = self.G(z, self.G.shared(gy))
        D_input = G_z if x is None else torch.cat([G_z, x], 0)
        D_class = gy if dy is None else torch.cat([gy, dy], 0)
        D_out = self.D(D_input, D_class)
        if x is not None:
            return torch.split(D_out, [G_z.shape[0], x.shape[0]])
        return D_out


def build() -> nn.Module:
    torch.manual_seed(0)
    return G_D()


def optimizers(model: Any) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Adam(model.D.parameters(), lr=2e-3, betas=(0.0, 0.999)),
        torch.optim.Adam(model.G.parameters(), lr=1e-3, betas=(0.0, 0.999)),
    ]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(21)
    return [
        (torch.randn(BATCH, 3, 4, 4, generator=gen), torch.randint(0, N_CLASSES, (BATCH,)))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    opt_d, opt_g = opts
    if "z_" not in memo:
        memo["z_"], memo["y_"] = prepare_z_y(BATCH)
    z_, y_ = memo["z_"], memo["y_"]
    x, y = batch
    opt_d.zero_grad()
    z_.sample_()
    y_.sample_()
    D_fake, D_real = run(z_[:BATCH], y_[:BATCH], x, y, train_G=False)
    D_loss = torch.mean(F.relu(1.0 - D_real)) + torch.mean(F.relu(1.0 + D_fake))
    D_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    z_.sample_()
    y_.sample_()
    D_fake = run(z_, y_, train_G=True)
    G_loss = -torch.mean(D_fake)
    G_loss.backward()
    opt_g.step()
    return {"D_loss": D_loss.detach(), "G_loss": G_loss.detach()}
