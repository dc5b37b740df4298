"""Replicate callbacks and overrides that write the replicas (issue 39, item 15): the user's
module comes out as torch leaves it.

Synchronized-BatchNorm-PyTorch (vendored in many repositories) calls
``__data_parallel_replicate__(ctx, copy_id)`` on every module of every replica, through
``DataParallelWithCallback`` (a ``replicate`` override) or ``patch_replication_callback`` (an
instance patch). Its BatchNorm then marks itself ``_is_parallel = True``: written on the user's
module, every later train-mode forward of the plain model would wait for replicas that never
come. torch's replica 0 is a copy; so is every replica here once ``replicate`` is overridden.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch import nn

import dataparallel as dp


class CallbackContext:
    pass


class TaggedBatchNorm(nn.BatchNorm1d):
    """The shape of SynchronizedBatchNorm1d: tagged by the callback; once tagged, a train-mode
    forward of copy 0 waits for the other copies (here with a timeout instead of forever).
    As the library's, it starts untagged (``_is_parallel = False`` in ``__init__``: issue 49,
    item 4, where the tag on copy 0 was written back to the module), and counts its forwards
    (a write of the forward's own, which must land)."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self._is_parallel = False
        self._parallel_id: int | None = None
        self.forwards = 0

    def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
        self._is_parallel = True
        self._parallel_id = copy_id
        if copy_id == 0:
            ctx.barrier = threading.Barrier(ctx.copies)  # type: ignore[attr-defined]
        self._barrier = ctx.barrier  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if getattr(self, "_is_parallel", False) and self.training:
            self._barrier.wait(timeout=5)  # the master waits for its slaves
        return super().forward(x)


def execute_replication_callbacks(modules: list[nn.Module]) -> None:
    """As Synchronized-BatchNorm-PyTorch's, with the copy count on the context."""
    n = len(list(modules[0].modules()))
    ctxs = [CallbackContext() for _ in range(n)]
    for ctx in ctxs:
        ctx.copies = len(modules)  # type: ignore[attr-defined]
    for i, module in enumerate(modules):
        for j, m in enumerate(module.modules()):
            callback = getattr(m, "__data_parallel_replicate__", None)
            if callback is not None:
                callback(ctxs[j], i)


class DataParallelWithCallback(dp.DataParallel):
    def replicate(self, module: nn.Module, device_ids: Any) -> list[nn.Module]:
        modules = super().replicate(module, device_ids)
        execute_replication_callbacks(modules)
        return modules


def patch_replication_callback(data_parallel: dp.DataParallel) -> None:
    old_replicate = data_parallel.replicate

    @functools.wraps(old_replicate)
    def new_replicate(module: nn.Module, device_ids: Any) -> list[nn.Module]:
        modules = old_replicate(module, device_ids)
        execute_replication_callbacks(modules)
        return modules

    data_parallel.replicate = new_replicate  # type: ignore[method-assign]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), TaggedBatchNorm(6), nn.ReLU(), nn.Linear(6, 2))


def _check(wrapper: dp.DataParallel, net: nn.Sequential) -> None:
    before = dict(vars(net[1]))
    x = torch.randn(8, 4)
    for _ in range(2):  # the replicas are kept between calls, and tagged again
        out = wrapper(x)
        out.sum().backward()
    assert out.shape == (8, 2)
    bn: Any = net[1]
    assert bn._is_parallel is False  # before: True, and the next line hung
    assert bn._parallel_id is None
    assert bn.forwards == 2  # the forward's own write lands, once per call
    assert set(vars(bn)) == set(before)
    assert int(bn.num_batches_tracked) == 2  # running statistics still land on the module
    net.train()
    net(x)  # a plain train-mode forward: no copy to wait for


def test_data_parallel_with_callback_leaves_the_module_untouched() -> None:
    net = _net()
    _check(DataParallelWithCallback(net, ["cpu", "cpu:1"]), net)


def test_patch_replication_callback_leaves_the_module_untouched() -> None:
    net = _net()
    wrapper = dp.DataParallel(net, ["cpu", "cpu", "cpu:1"])
    patch_replication_callback(wrapper)
    _check(wrapper, net)


def test_without_an_override_replica_zero_is_still_the_module() -> None:
    # ids, compared outside forward: inside it, ``spy`` (a closure over the module) is rebound
    # to each replica, as every closure over a module of the tree is
    seen: list[int] = []
    net = nn.Linear(4, 2)

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(id(self))
            return self.inner(x)

    spy = Spy()
    dp.DataParallel(spy, ["cpu", "cpu"])(torch.randn(4, 4))
    assert sorted(i == id(spy) for i in seen) == [False, True]
