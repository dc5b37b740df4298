"""The baseline of ``bench_train_ddp.py``: a raw torch DDP training loop, run under torchrun.

It does the work ``dataparallel train --strategy ddp --data random`` does, written as torch's
DDP tutorial writes it and with nothing of dataparallel's beyond the data and the network's
definition (so both sides train the same tensors with the same model): ``init_process_group``
(gloo), ``DistributedDataParallel``, ``DistributedSampler`` and a ``DataLoader``; SGD with the
same learning rate and momentum; the same global batch cut over the ranks; a mean
cross-entropy per step and ``loss.item()`` to sum the epoch's loss. After each epoch, as the CLI
does, it sums the epoch's loss over the ranks and scores the test set (each rank its shard, the
correct counts summed with one all-reduce).

Its figure is the CLI's: samples per second over the training loops alone (each epoch's loop
timed on rank 0, evaluation and setup left out), written by rank 0 as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/raw_ddp.py \\
        --epochs 100 --out raw.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from dataparallel.app.demo.data import load_dataset
from dataparallel.app.demo.models import build_model

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Train, time the loops, write ``--out`` on rank 0; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="random")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    data = load_dataset(args.data)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(data.input_shape, len(data.classes)))
    optimizer = torch.optim.SGD(model.parameters(), lr=data.lr, momentum=0.9)
    # The global batch cut as the CLI cuts it: larger parts first.
    local = data.batch_size // world + (1 if rank < data.batch_size % world else 0)
    sampler = DistributedSampler(data.train, shuffle=True, seed=0)
    loader = DataLoader(data.train, batch_size=local, sampler=sampler)
    test_loader = DataLoader(
        data.test, batch_size=data.batch_size, sampler=DistributedSampler(data.test, shuffle=False)
    )
    seconds, samples, accuracy = 0.0, 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum, start = 0.0, time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(y)
        seconds += time.perf_counter() - start
        samples += len(data.train_y)
        # The epoch's figures, untimed: the loss over the ranks, the test accuracy.
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += int((model.module(x).argmax(dim=1) == y).sum())
        totals = torch.tensor([loss_sum, correct], dtype=torch.float64)
        dist.all_reduce(totals)
        accuracy = float(totals[1]) / len(data.test_y)
    if rank == 0:
        figures = {
            "samples_per_second": samples / seconds,
            "epochs": args.epochs,
            "test_accuracy": accuracy,
        }
        Path(args.out).write_text(json.dumps(figures) + "\n")
    # Outside the timed loops: the same careful teardown as the CLI's (a gloo group destroyed
    # right after a collective, the GIL held, can abort or deadlock in torch).
    dist.barrier()
    time.sleep(0.02)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
