"""Our DDP training path against a hand-written torch DDP loop: samples per second.

Two gloo processes on this machine train the tutorial CNN on random digits-shaped data
(1x8x8 images, 10 classes) for one epoch per run, three ways, interleaved within each repeat
(the order rotates from repeat to repeat so that neither side always runs first):

- ``plain``: ``init_process_group`` + ``DistributedDataParallel`` + ``DistributedSampler``,
  written by hand as in torch's tutorial;
- ``ours``: ``ddp_session`` + ``ShardedSampler`` + a ``DataLoader``;
- ``ours+shard``: ``ddp_session``, every rank reading the same global batches and taking its
  part with ``shard`` (the path for data that is not a map-style dataset).

Each run's time is the slowest rank's (barriers around the loop); setup (process group, DDP
construction) is timed apart. Reported: the median samples/s of each way and the ratios
``ours / plain``, ``ours+shard / plain`` (target >= 0.97), each the median over repeats of
the ratio within one repeat (the ratio of the medians is kept beside it).

    python benchmarks/bench_ddp.py --out benchmarks/results/ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dataparallel.app.demo.models import Net
from dataparallel.app.launch import free_port
from dataparallel.distributed import ShardedSampler, ddp_session, shard

__all__ = ["main"]

WAYS = ("plain", "ours", "ours+shard")


def _dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.rand(samples, 1, 8, 8, generator=g), torch.randint(0, 10, (samples,), generator=g)
    )


def _new_model() -> Net:
    torch.manual_seed(0)
    return Net(1, 8, 10)


def _timed_epoch(
    model: torch.nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], scale: float
) -> tuple[float, int]:
    """One epoch of SGD; returns the slowest rank's seconds and this rank's sample count."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dist.barrier()
    start = time.perf_counter()
    seen = 0
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y, reduction="sum") * scale
        loss.backward()
        optimizer.step()
        seen += len(y)
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()), seen


@contextmanager
def _plain_session(module: torch.nn.Module) -> Iterator[DistributedDataParallel]:
    dist.init_process_group("gloo")
    try:
        yield DistributedDataParallel(module)
    finally:
        # The same careful teardown as ddp_session's (outside the timed loop): destroying a
        # gloo group right after a collective can deadlock in torch.
        dist.barrier()
        time.sleep(0.02)
        dist.destroy_process_group()


def _run(way: str, data: TensorDataset, batch: int, epoch: int) -> dict[str, float]:
    """One epoch of one way; returns samples/s (global) and setup seconds."""
    t0 = time.perf_counter()
    world = int(os.environ["WORLD_SIZE"])
    local_batch = batch // world
    # per-rank sum scaled so that DDP's average over ranks is the global mean
    scale = world / batch
    if way == "plain":
        with _plain_session(_new_model()) as ddp:
            sampler = DistributedSampler(data, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            loader = DataLoader(data, batch_size=local_batch, sampler=sampler)
            setup = time.perf_counter() - t0
            seconds, seen = _timed_epoch(ddp, iter(loader), scale)
    elif way == "ours":
        with ddp_session(_new_model()) as (ddp, _info):
            ours = ShardedSampler(data, shuffle=True, seed=0)
            ours.set_epoch(epoch)
            loader = DataLoader(data, batch_size=local_batch, sampler=ours)
            setup = time.perf_counter() - t0
            seconds, seen = _timed_epoch(ddp, iter(loader), scale)
    else:
        with ddp_session(_new_model()) as (ddp, _info):
            x_all, y_all = data.tensors
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
            x_all, y_all = x_all[order], y_all[order]

            def global_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
                for start in range(0, len(y_all), batch):
                    xs, ys = shard((x_all[start : start + batch], y_all[start : start + batch]))
                    yield xs, ys

            setup = time.perf_counter() - t0
            seconds, seen = _timed_epoch(ddp, global_batches(), scale)
    total = seen * world  # every rank sees the same count here (the batch divides evenly)
    return {"samples_per_s": total / seconds, "seconds": seconds, "setup_s": setup}


def _worker(
    local_rank: int, world: int, ports: list[int], args: argparse.Namespace, out_file: str
) -> None:
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR="127.0.0.1",
    )
    torch.set_num_threads(1)
    data = _dataset(args.steps * args.batch)
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    fresh_ports = iter(ports)

    def run(way: str, epoch: int) -> dict[str, float]:
        # A fresh port per process group: a rank that starts the next group while another
        # still tears down the last one must not find the old store and its stale addresses.
        os.environ["MASTER_PORT"] = str(next(fresh_ports))
        return _run(way, data, args.batch, epoch)

    run("plain", 0)  # warm-up: imports, allocator, gloo connections
    run("ours", 0)
    for repeat in range(args.repeats):
        rotation = repeat % len(WAYS)
        for way in WAYS[rotation:] + WAYS[:rotation]:
            results[way].append(run(way, repeat + 1))
    if local_rank == 0:
        Path(out_file).write_text(json.dumps(results))


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the table; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/ddp.json")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150, help="global batches per epoch")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    if args.batch % args.nproc:
        parser.error(f"--batch {args.batch} must divide by --nproc {args.nproc}")

    with tempfile.TemporaryDirectory() as tmp:
        raw_file = os.path.join(tmp, "raw.json")
        fn: Callable[..., None] = _worker
        ports: set[int] = set()
        while len(ports) < 2 + len(WAYS) * args.repeats:
            ports.add(free_port())
        mp.spawn(fn, args=(args.nproc, sorted(ports), args, raw_file), nprocs=args.nproc)
        raw = json.loads(Path(raw_file).read_text())

    medians = {way: statistics.median(r["samples_per_s"] for r in raw[way]) for way in WAYS}
    setup = {way: statistics.median(r["setup_s"] for r in raw[way]) for way in WAYS}
    # Each repeat ran every way back to back: a ratio is the median of the per-repeat ratios,
    # so that a slow spell of the machine hits both sides of each pair.
    ratios = {
        f"{way}/plain": statistics.median(
            r["samples_per_s"] / p["samples_per_s"]
            for r, p in zip(raw[way], raw["plain"], strict=True)
        )
        for way in WAYS[1:]
    }
    ratios_of_medians = {f"{way}/plain": medians[way] / medians["plain"] for way in WAYS[1:]}
    report: dict[str, Any] = {
        "benchmark": "ddp",
        "config": {
            "processes": args.nproc,
            "backend": "gloo",
            "device": "cpu",
            "model": "Net(1, 8, 10)",
            "global_batch": args.batch,
            "steps_per_epoch": args.steps,
            "repeats": args.repeats,
            "threads_per_process": 1,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "samples_per_s_median": medians,
        "setup_s_median": setup,
        "ratios": ratios,
        "ratios_of_medians": ratios_of_medians,
        "target_ratio": 0.97,
        "runs": raw,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    rows = [("way", "samples/s (median)", "paired ratio to plain", "setup s", "runs")]
    for way in WAYS:
        rows.append(
            (
                way,
                f"{medians[way]:.0f}",
                "1" if way == "plain" else f"{ratios[f'{way}/plain']:.3f}",
                f"{setup[way]:.3f}",
                " ".join(f"{r['samples_per_s']:.0f}" for r in raw[way]),
            )
        )
    print(_table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
