"""Synchronized-BatchNorm-PyTorch: BatchNorm whose replicas meet through replication
callbacks and compute the whole batch's statistics.

Source: vacancy/Synchronized-BatchNorm-PyTorch sync_batchnorm/batchnorm.py

Ported: ``DataParallelWithCallback`` (a ``replicate`` override that calls every module's
``__data_parallel_replicate__(ctx, copy_id)``), and the synchronised BatchNorm: ``__init__``
sets ``_is_parallel = False``; the callback tags each copy parallel and connects copy 0 (the
master) with the others through a shared context; in training, each copy sends its chunk's
per-channel sum, sum of squares and count, the master reduces them, computes the batch's mean
and inverse standard deviation (and updates the running statistics with the unbiased
variance), and hands them back; every copy then normalises with them. Reimplemented for CPU
devices (the library reduces and broadcasts with CUDA's ``ReduceAddCoalesced``/``Broadcast``).
The user's BatchNorm must come out untagged (the library's own plain forward then works).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

ATTRIBUTES = ("bn._is_parallel", "bn._parallel_id")


class _Future:
    def __init__(self) -> None:
        self._result: Any = None
        self._cond = threading.Condition()

    def put(self, result: Any) -> None:
        with self._cond:
            self._result = result
            self._cond.notify()

    def get(self) -> Any:
        with self._cond:
            while self._result is None:
                self._cond.wait(timeout=30)
            result, self._result = self._result, None
            return result


class _Master:
    """Copy 0's side: collects every child's sums, returns each its mean and inverse std."""

    def __init__(self, bn: SynchronizedBatchNorm1d, children: int) -> None:
        self.bn, self.children = bn, children
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.futures = [_Future() for _ in range(children)]

    def collect(self, sums: tuple[torch.Tensor, torch.Tensor, int]) -> Any:
        parts = [sums] + [self.inbox.get(timeout=30) for _ in range(self.children)]
        parts = [parts[0], *sorted(parts[1:], key=lambda p: p[3])]
        device = sums[0].device
        total = sum(p[0].to(device) for p in parts)
        squares = sum(p[1].to(device) for p in parts)
        count = sum(p[2] for p in parts)
        mean, inv_std = self.bn.compute_mean_std(total, squares, count)
        for part in parts[1:]:
            self.futures[part[3] - 1].put((mean.to(part[0].device), inv_std.to(part[0].device)))
        return mean, inv_std


class SynchronizedBatchNorm1d(nn.BatchNorm1d):
    def __init__(self, features: int) -> None:
        super().__init__(features)
        self._is_parallel = False
        self._parallel_id: int | None = None
        self._sync: Any = None

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        self._is_parallel = True
        self._parallel_id = copy_id
        if copy_id == 0:
            ctx.master = _Master(self, ctx.copies - 1)
        self._sync = ctx.master

    def compute_mean_std(self, total: torch.Tensor, squares: torch.Tensor, count: int) -> Any:
        mean = total / count
        sumvar = squares - total * mean
        unbiased, bias_var = sumvar / (count - 1), sumvar / count
        with torch.no_grad():
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(m * mean.detach().to(self.running_mean.dtype))
            self.running_var.mul_(1 - m).add_(m * unbiased.detach().to(self.running_var.dtype))
        return mean, (
            bias_var + self.eps
        ) ** -0.5  # (the library clamps to eps: F.batch_norm adds it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._is_parallel and self.training):
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias,
                self.training, self.momentum, self.eps,
            )  # fmt: skip
        # (in float64: the library's float32 sum of squares loses digits to cancellation,
        # which is its own numerics, not data parallelism's)
        wide = x.double()
        sums = (wide.sum(0), (wide * wide).sum(0), x.shape[0])
        if self._parallel_id == 0:
            mean, inv_std = self._sync.collect(sums)
        else:
            self._sync.inbox.put((*sums, self._parallel_id))
            mean, inv_std = self._sync.futures[self._parallel_id - 1].get()
        return (x - mean.to(x.dtype)) * inv_std.to(x.dtype) * self.weight + self.bias


def execute_replication_callbacks(modules: list[nn.Module]) -> None:
    master = modules[0]
    contexts = [type("Context", (), {"copies": len(modules)})() for _ in master.modules()]
    for copy_id, module in enumerate(modules):
        for ctx, m in zip(contexts, module.modules(), strict=True):
            callback = getattr(m, "__data_parallel_replicate__", None)
            if callback is not None:
                callback(ctx, copy_id)


class DataParallelWithCallback(dp.DataParallel):
    def replicate(self, module: nn.Module, device_ids: Any) -> list[nn.Module]:
        modules = super().replicate(module, device_ids)
        execute_replication_callbacks(modules)
        return modules


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.bn = SynchronizedBatchNorm1d(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return DataParallelWithCallback(model, devices)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(11)
    return [
        (torch.randn(7, 5, generator=gen), torch.randint(0, 3, (7,), generator=gen))
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
