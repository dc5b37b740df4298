"""The ``ddp`` strategy of ``dataparallel train``: one process per device.

Started by :func:`dataparallel.app.launch.launch` or torchrun, each process trains its share:
``ddp_session`` wraps the model in ``DistributedDataParallel``, ``ShardedSampler`` partitions
the training and test sets exactly, every rank runs every step of the epoch (a rank whose shard
has run out steps on zero samples, so all ranks all-reduce the same gradients and their
optimizers stay equal to one process's), one all-reduce per epoch
sums the loss and every rank's per-class test counts (exact), and rank 0 reports. It lives
apart from the dp loop in :mod:`dataparallel.app.demo.train` because its batching (a global batch
cut over ranks) and its evaluation (gathered over ranks) differ from dp's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO, TypeVar

import torch
from torch import nn

from dataparallel.app.demo.checkpoint import (
    checkpoint_state,
    end_epoch,
    resume,
    resume_message,
    run_config,
)
from dataparallel.app.demo.data import DemoData
from dataparallel.app.demo.models import build_model
from dataparallel.app.demo.options import (
    EpochStats,
    RunClock,
    UsageError,
    check_finite_loss,
    load_data,
    resolve_hyper,
    train_result,
)
from dataparallel.app.demo.report import progress_bar, progress_shown

if TYPE_CHECKING:  # annotations only
    from dataparallel.app.demo.options import TrainOptions, TrainResult

__all__ = ["check_batchnorm_batches", "ddp_train"]

_T = TypeVar("_T")


def _agree(step: Callable[[], _T], rank: int, world: int) -> _T:
    """Run a setup step that may fail on some ranks only, and tell every rank the outcome.

    A checkpoint or dataset on one node's disk fails on the other node's ranks alone: before,
    the failing rank ended without a word (only rank 0 speaks) and rank 0 went on into a
    collective that failed with a raw "Connection closed by peer". Here every rank learns
    (one ``all_gather_object``) which ranks failed and why: a failure every rank raised alike
    is said once by rank 0, as before; otherwise the first failing rank says it, with its rank
    (``UsageError.speaker``), and the others end with the same exit code and no line.

    Raises:
        UsageError: this rank's failure, or (silent) another rank's.
    """
    import torch.distributed as dist

    failure: UsageError | None = None
    try:
        result = step()
    except UsageError as exc:
        failure = exc
    if world > 1 and dist.is_available() and dist.is_initialized():
        said: list[str | None] = [None] * world
        mine = None if failure is None else " ".join(str(failure).split())
        dist.all_gather_object(said, mine)
        failed = [r for r, text in enumerate(said) if text is not None]
        if failed and not (len(failed) == world and len(set(said)) == 1):
            first = failed[0]
            if rank == first and failure is not None:
                failure.speaker = "self"
                raise failure
            quiet = UsageError(f"rank {first} failed: {said[first]}")
            quiet.speaker = "nobody"
            raise quiet
    if failure is not None:
        raise failure
    return result


def _rank_batches(n: int, world: int, batch_size: int) -> tuple[list[int], list[int]]:
    """Each rank's sample count (ShardedSampler's split) and batch size (the global batch cut as
    evenly as possible, larger first)."""
    base, extra = divmod(n, world)
    counts = [base + (1 if r < extra else 0) for r in range(world)]
    sizes = [batch_size // world + (1 if r < batch_size % world else 0) for r in range(world)]
    return counts, sizes


def _step_totals(counts: list[int], sizes: list[int]) -> list[int]:
    """The global batch of each step: every rank's k-th batch, 0 for a rank that has finished."""
    steps = max(-(-c // s) for c, s in zip(counts, sizes, strict=True))
    return [
        sum(max(0, min(s, c - k * s)) for c, s in zip(counts, sizes, strict=True))
        for k in range(steps)
    ]


def _lone_sample(n: int, world: int, batch_size: int) -> int | None:
    """The first rank whose shard ends in a batch of one sample, or ``None``."""
    counts, sizes = _rank_batches(n, world, batch_size)
    for rank, (c, s) in enumerate(zip(counts, sizes, strict=True)):
        if s > 0 and c % s == 1 and c > 1:
            return rank
    return None


def check_batchnorm_batches(n: int, world: int, batch_size: int, batchnorm: str) -> None:
    """Refuse, before any step, a ddp run whose BatchNorm would meet a batch of one sample.

    Each rank normalises its own share of every global batch (``--batchnorm``), and torch's
    BatchNorm refuses one sample in training ("Expected more than 1 value per channel"): a
    rank whose shard ends in a one-sample batch would end the job at that step of the first
    epoch, with a traceback from each rank. Said here in one line, with a batch size that
    avoids it.

    Raises:
        UsageError: some rank's shard ends in a batch of one sample.
    """
    if batchnorm != "chunk" or world < 2:
        return
    rank = _lone_sample(n, world, batch_size)
    if rank is None:
        return
    counts, sizes = _rank_batches(n, world, batch_size)
    better = next(
        (
            b
            for b in range(batch_size + 1, batch_size + 8 * world)
            if _lone_sample(n, world, b) is None
        ),
        None,
    )
    fix = f"--batch-size {better}" if better is not None else "another --batch-size"
    raise UsageError(
        f"--batchnorm: under --strategy ddp on {world} processes, --batch-size {batch_size} "
        f"gives rank {rank} a last batch of 1 sample in every epoch (its {counts[rank]} "
        f"samples in batches of {sizes[rank]}), and BatchNorm cannot normalise one sample in "
        f"training; use {fix}, or --strategy dp (each global batch normalised per chunk)"
    )


def _loss_scales(counts: list[int], sizes: list[int], world: int) -> list[float | None]:
    """Per step, what this run multiplies each rank's summed loss by, or None for the mean.

    DDP averages gradients over ranks, so the global batch's mean gradient is each rank's
    summed loss times ``world / global batch``. Where every rank has the same share of a step
    (``share * world == global batch``) that is each rank's plain mean, which costs one op
    less (a mean-reduced loss, no multiplication and its backward), so it is used there.
    """
    scales: list[float | None] = []
    for k, total in enumerate(_step_totals(counts, sizes)):
        shares = {max(0, min(s, c - k * s)) for c, s in zip(counts, sizes, strict=True)}
        scales.append(None if len(shares) == 1 else world / total)
    return scales


def ddp_train(opts: TrainOptions, out: TextIO) -> TrainResult | None:
    """Train in this process as one rank of a ddp run; rank 0 returns the figures, others None.

    Raises:
        UsageError: a bad option, dataset or checkpoint, or a global batch smaller than the
            number of processes.
    """
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from dataparallel.distributed import (
        ShardedSampler,
        ddp_session,
        destroy_distributed,
        gather_all,
        init_distributed,
    )

    backend = "gloo" if opts.devices == "cpu" else None  # --devices cpu: the CPU, even with GPUs
    # Join the job first (ddp_session reuses the group), so that a dataset one rank cannot
    # load is told to every rank rather than left to the rendezvous timeout.
    joined = init_distributed(backend=backend)
    try:

        def setup() -> tuple[DemoData, tuple[int, int, float]]:
            data = load_data(opts)
            hyper = resolve_hyper(data, opts)
            world = joined.world_size
            check_batchnorm_batches(len(data.train_y), world, hyper[1], opts.batchnorm)
            return data, hyper

        data, (epochs, batch_size, lr) = _agree(setup, joined.rank, joined.world_size)
        torch.manual_seed(opts.seed)
        net = build_model(
            data.input_shape, len(data.classes), trace=opts.trace, batchnorm=opts.batchnorm
        )
    except BaseException:
        destroy_distributed(barrier=False)
        raise
    with ddp_session(net, backend=backend) as (ddp, info):
        main, world, device = info.rank == 0, info.world_size, info.device
        config = run_config(data, batch_size, opts, lr, world)
        counts, sizes = _rank_batches(len(data.train_y), world, batch_size)
        if min(sizes) < 1:
            raise UsageError(
                f"--batch-size: expected at least one sample per process ({world}), got "
                f"{batch_size}; use --batch-size {world} or more"
            )
        totals = _step_totals(counts, sizes)
        # How each step's loss is reduced (see backward below), decided once per run.
        scales = _loss_scales(counts, sizes, world)
        # A rank whose shard has run out still takes the epoch's last steps, on zero samples:
        # its gradients are zeros, DDP all-reduces them with the others', and every rank calls
        # optimizer.step() on the same gradients, as one process does. Join instead let the
        # finished rank skip its steps, and its momentum (never copied back) drifted.
        empty = (data.train_x[:0], data.train_y[:0])
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=opts.momentum)
        history: list[EpochStats] = []
        start_epoch = 0
        if opts.resume and opts.checkpoint:
            path = opts.checkpoint  # on every node's disk, or refused on every rank at once
            start_epoch, history = _agree(
                lambda: resume(path, config, net, optimizer, None, epochs), info.rank, world
            )
            if main:
                print(resume_message(path, start_epoch, epochs), file=out)
        sampler = ShardedSampler(data.train, shuffle=True, seed=opts.seed)
        loader = DataLoader(data.train, batch_size=sizes[info.rank], sampler=sampler)
        n = len(data.train_y)
        clock = RunClock()
        last_samples, last_seconds = 0, 0.0
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            ddp.train()
            loss_sum, seen, t0 = 0.0, 0, time.perf_counter()
            # No bar object at all when none is shown (building one costs a tenth of a step).
            show = main and progress_shown(opts.progress)
            bar = progress_bar(n, f"epoch {epoch + 1}/{epochs}", True) if show else None
            with contextlib.ExitStack() as stack:
                if bar is not None:
                    stack.enter_context(contextlib.closing(bar))
                # The step does what a hand-written DDP loop does, plus a clock read: the
                # per-step figures of the report are kept as plain numbers.
                batches = iter(loader)
                for k, scale in enumerate(scales):
                    step_start = time.perf_counter()
                    x, y = next(batches, empty)  # no batch left here: a step on zero samples
                    x, y = x.to(device), y.to(device)
                    optimizer.zero_grad()
                    output = ddp(x)
                    if scale is None:  # every rank has this step's share: the plain mean
                        loss = F.cross_entropy(output, y)
                        loss.backward()
                        value = loss.item() * y.shape[0]
                    else:
                        summed = F.cross_entropy(output, y, reduction="sum")
                        (summed * scale).backward()
                        value = summed.item()
                    optimizer.step()
                    samples = int(y.shape[0])
                    loss_sum, seen = loss_sum + value, seen + samples
                    last_samples, last_seconds = samples, time.perf_counter() - step_start
                    if bar is not None:
                        bar.update(totals[k])
                        bar.set_postfix(loss=f"{value / max(samples, 1):.4f}")
            seconds = time.perf_counter() - t0
            clock.add(n, seconds)
            # The epoch's figures in one all-reduce: the loss sums and the test counts.
            (loss_total, seen_total), (accuracy, classes) = _epoch_figures(
                ddp.module, data, batch_size, opts.trace, device, [loss_sum, seen]
            )
            # Every rank sees the same sums, so every rank stops here together (a diverged
            # model was only scored; no checkpoint of it is written).
            check_finite_loss(loss_total, epoch + 1, None, lr)
            stats = EpochStats(epoch + 1, loss_total / seen_total, accuracy, n / seconds, seconds)
            history.append(stats)
            if main:
                state = functools.partial(
                    checkpoint_state, epoch + 1, net, optimizer, history, config
                )
                end_epoch(stats, epochs, out, opts.checkpoint, state, first=epoch == start_epoch)
        last = torch.tensor([[info.rank, last_samples, last_seconds]], dtype=torch.float64)
        loads = gather_all(last)
        _, (accuracy, classes) = _epoch_figures(
            ddp.module, data, batch_size, opts.trace, device, []
        )
        devices = [str(d) for d in gather_all([str(device)])]
    if not main:
        return None
    table = ["rank  samples  seconds"] + [
        f"{int(r):>4}  {int(s):>7}  {t:7.4f}" for r, s, t in loads.tolist()
    ]
    last_call = {
        "devices": devices,
        "chunk_sizes": [int(s) for s in loads[:, 1].tolist()],
        "seconds": [float(t) for t in loads[:, 2].tolist()],
    }
    hyper, scores = (epochs, batch_size), (accuracy, classes)
    return train_result(
        data, "ddp", devices, hyper, history, scores, clock, ("\n".join(table), last_call)
    )


def _epoch_figures(
    net: nn.Module,
    data: DemoData,
    batch_size: int,
    trace: bool,
    device: torch.device,
    sums: list[float],
) -> tuple[list[float], tuple[float, list[tuple[str, int, int]]]]:
    """``sums`` added over the ranks, and the test accuracy overall and per class.

    Each rank scores its shard of the test set (:class:`ShardedSampler`'s contiguous block,
    read by slicing: no sampler or collate per sample) and counts its correct and total
    samples per class; one all-reduce of those counts and ``sums`` gives every rank the exact
    totals, every test sample counted once (integers are exact in float64). One collective per
    epoch, where gathering predictions took two rounds of two.
    """
    import torch.distributed as dist

    from dataparallel.distributed import ShardedSampler

    k = len(data.classes)
    indices = ShardedSampler(data.test, shuffle=False).indices()
    start, stop = (indices[0], indices[-1] + 1) if indices else (0, 0)
    correct = torch.zeros(k, dtype=torch.long)
    total = torch.zeros(k, dtype=torch.long)
    net.eval()
    net.trace = False  # type: ignore[assignment]
    try:
        with torch.no_grad():
            for first in range(start, stop, batch_size):
                x = data.test_x[first : min(first + batch_size, stop)]
                y = data.test_y[first : min(first + batch_size, stop)]
                pred = net(x.to(device)).argmax(dim=1).cpu()
                total += torch.bincount(y, minlength=k)
                correct += torch.bincount(y[pred == y], minlength=k)
    finally:
        net.trace = trace  # type: ignore[assignment]
    row = torch.cat([torch.tensor(sums, dtype=torch.float64), correct.double(), total.double()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(row)
    summed = [float(v) for v in row[: len(sums)].tolist()]
    counts = row[len(sums) :].long().view(2, k)
    classes = [(data.classes[i], int(counts[0, i]), int(counts[1, i])) for i in range(k)]
    seen = int(counts[1].sum())
    return summed, ((int(counts[0].sum()) / seen if seen else 0.0), classes)
