"""Uneven shards, stateful optimizers: every rank takes every step, equal to one process.

A rank whose shard has run out still takes the step, on a batch of zero samples, so every rank
all-reduces the same gradients and calls ``optimizer.step()`` as often as one process does: the
parameters and the optimizer state (momentum, Adam's moments and step count) stay equal to one
process's over 3 epochs, on 2 and 3 ranks. (Join, the recipe this replaces, skipped the finished
ranks' optimizer steps: 0.417 between ranks after epoch 2 with momentum.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dataparallel.distributed import ShardedSampler, ddp_session

from ._helpers import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# 13 samples in batches of 2: 7/6 on 2 ranks (4 and 3 steps), 5/4/4 on 3 (3, 2 and 2 steps)
SIZE, BATCH, EPOCHS = 13, 2, 3
OPTIMIZERS = ("sgd", "adam")


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(
        torch.randn(SIZE, 6, generator=g), torch.randint(0, 3, (SIZE,), generator=g)
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.3, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.05, weight_decay=0.01)


def _plan(world: int) -> tuple[list[int], int, list[int]]:
    """Each rank's sample count, the steps per epoch (the most any rank has), and each step's
    global batch: the guide's recipe."""
    counts = [len(ShardedSampler(range(SIZE), rank=r, world_size=world)) for r in range(world)]
    steps = -(-max(counts) // BATCH)
    totals = [sum(min(BATCH, max(0, c - k * BATCH)) for c in counts) for k in range(steps)]
    return counts, steps, totals


def _train(ddp: nn.Module, name: str, world: int) -> dict[str, Any]:
    """The guide's recipe: every rank runs the same steps, a finished rank on zero samples."""
    data = _dataset()
    optimizer = _optimizer(name, ddp.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sampler = ShardedSampler(data, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    _, steps, totals = _plan(world)
    empty = (data.tensors[0][:0], data.tensors[1][:0])  # a batch of zero samples
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for k in range(steps):
            x, y = next(batches, empty)  # no batch left: the step on zero samples
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y, reduction="sum") * world / totals[k]
            loss.backward()
            optimizer.step()
            scheduler.step()
    module = ddp.module if isinstance(ddp, DistributedDataParallel) else ddp
    return {"model": module.state_dict(), "optimizer": optimizer.state_dict()}


def _worker(out_dir: str) -> None:
    with ddp_session(_model(), backend="gloo") as (ddp, info):
        states = {OPTIMIZERS[0]: _train(ddp, OPTIMIZERS[0], info.world_size)}
        for name in OPTIMIZERS[1:]:  # the same process group, a fresh model
            states[name] = _train(DistributedDataParallel(_model()), name, info.world_size)
        torch.save(states, Path(out_dir) / f"rank{info.rank}.pt")


def _one_process(name: str, world: int) -> dict[str, Any]:
    """One process on each step's global batch: every rank's k-th batch, in rank order."""
    data = _dataset()
    model = _model()
    optimizer = _optimizer(name, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    _, steps, _ = _plan(world)
    for epoch in range(EPOCHS):
        orders = []
        for r in range(world):
            sampler = ShardedSampler(data, seed=1, rank=r, world_size=world)
            sampler.set_epoch(epoch)
            orders.append(sampler.indices())
        for k in range(steps):
            index = [i for order in orders for i in order[k * BATCH : (k + 1) * BATCH]]
            x, y = data[index]
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            scheduler.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _flat(state: dict[str, Any]) -> torch.Tensor:
    """The model's parameters and every tensor of the optimizer's state, in one vector."""
    parts = [v.flatten() for v in state["model"].values()]
    for slot in state["optimizer"]["state"].values():
        parts += [torch.as_tensor(v, dtype=torch.float32).flatten() for v in slot.values()]
    return torch.cat(parts)


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_shards_train_as_one_process(tmp_path: Path, world: int) -> None:
    counts, _, _ = _plan(world)
    assert len({-(-c // BATCH) for c in counts}) > 1  # some rank runs out before the others
    run_workers(_worker, world, str(tmp_path))
    initial = torch.cat([p.detach().flatten() for p in _model().parameters()])
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name in OPTIMIZERS:
        expected = _flat(_one_process(name, world))
        assert not torch.allclose(expected[: initial.numel()], initial)  # training moved it
        scale = expected.abs().max()
        ranks = [_flat(states[name]) for states in saved]
        for rank, got in enumerate(ranks):
            assert got.shape == expected.shape, name
            difference = (got - expected).abs().max() / scale
            assert difference < 1e-5, f"{name}, rank {rank}: {difference:.3g} of the largest off"
            assert torch.equal(got, ranks[0]), f"{name}: rank {rank} differs from rank 0"
