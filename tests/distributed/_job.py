"""A small job for the launcher tests, run in each worker as ``python -m tests.distributed._job``.

``python -m tests.distributed._job train OUT``: all-reduce, one DDP training step of the tutorial
CNN, and a check that the parameters agree on every rank; writes ``OUT/ok-<rank>``.

``python -m tests.distributed._job fail OUT``: every worker writes ``OUT/pid-<rank>``; rank 1
then raises while the others wait forever, so only the launcher can end the job.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dataparallel.app.demo.models import Net
from dataparallel.distributed import ddp_session, gather_all, init_distributed, shard


def train(out: Path) -> None:
    torch.manual_seed(0)
    with ddp_session(Net(1, 8, 10)) as (ddp, info):
        value = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(value)
        expected = info.world_size * (info.world_size + 1) / 2
        if value.item() != expected:
            raise RuntimeError(f"all_reduce: expected {expected}, got {value.item()}")
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
        xs, ys = shard((x, y))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        F.cross_entropy(ddp(xs), ys).backward()
        optimizer.step()
        flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
        everyone = gather_all(flat.unsqueeze(0))  # (world_size, parameters)
        if not all(torch.equal(row, flat) for row in everyone):
            raise RuntimeError("parameters differ across ranks after a DDP step")
        (out / f"ok-{info.rank}").write_text(f"{info.world_size} {os.environ['LOCAL_RANK']}")


def fail(out: Path) -> None:
    info = init_distributed()
    (out / f"pid-{info.rank}").write_text(str(os.getpid()))
    if info.rank == 1:
        while len(list(out.glob("pid-*"))) < info.world_size:  # every worker has started
            time.sleep(0.05)
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(600)  # never returns by itself: the launcher must stop it


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    {"train": train, "fail": fail}[mode](folder)
