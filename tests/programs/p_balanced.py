"""Balanced-DataParallel: a hand-written forward that scatters with a smaller first chunk, then
replicates, applies and gathers, torch's four steps called one by one.

Source: Link-Li/Balanced-DataParallel data_parallel_my_v2.py

Ported: ``BalancedDataParallel(gpu0_bsz, ...)``, a DataParallel subclass whose ``forward``
calls ``self.scatter``, ``self.replicate``, ``self.parallel_apply`` and ``self.gather`` itself,
and whose ``scatter`` gives the first device ``gpu0_bsz`` samples and splits the rest evenly
(``dp.scatter_kwargs`` with ``chunk_sizes``, where the script cuts the tensors by hand); the
model is a small classifier with a mean cross-entropy computed outside, as in the script's
training loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp


class BalancedDataParallel(dp.DataParallel):
    def __init__(self, gpu0_bsz: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gpu0_bsz = gpu0_bsz

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        device_ids = self.device_ids
        inputs, kwargs = self.scatter(inputs, kwargs, device_ids)
        replicas = self.replicate(self.module, device_ids[: len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, kwargs)
        return self.gather(outputs, self.output_device)

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
        batch = inputs[0].shape[self.dim]
        rest = len(device_ids) - 1
        sizes = [self.gpu0_bsz] + [(batch - self.gpu0_bsz) // rest] * rest
        for i in range(batch - sum(sizes)):
            sizes[1 + i] += 1
        return dp.scatter_kwargs(inputs, kwargs, device_ids, self.dim, chunk_sizes=sizes)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return BalancedDataParallel(1, model, devices)  # the first device takes one sample


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(10)
    return [
        (torch.randn(8, 6, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    x, y = batch
    out = run(x)
    loss = F.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "out": out.detach()}
