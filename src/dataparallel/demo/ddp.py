"""The ``ddp`` strategy of ``dataparallel train``: one process per device.

Started by :func:`dataparallel.launch.launch` or torchrun, each process trains its share:
``ddp_session`` wraps the model in ``DistributedDataParallel``, ``ShardedSampler`` partitions
the training and test sets exactly, ``Join`` covers ranks with fewer steps (only when some
rank has fewer: otherwise it would cost an all-reduce per step), ``gather_all``
brings every rank's predictions together for exact test counts, and rank 0 reports. It lives
apart from the dp loop in :mod:`dataparallel.demo.train` because its batching (a global batch
cut over ranks) and its evaluation (gathered over ranks) differ from dp's.
"""

from __future__ import annotations

import contextlib
import time
from typing import TextIO

import torch
from torch import nn

from dataparallel.demo.checkpoint import (
    checkpoint_message,
    checkpoint_state,
    resume,
    run_config,
    save_checkpoint,
)
from dataparallel.demo.data import DemoData
from dataparallel.demo.models import build_model
from dataparallel.demo.options import (
    EpochStats,
    TrainOptions,
    TrainResult,
    UsageError,
    check_finite_loss,
    load_data,
    resolve_hyper,
)
from dataparallel.demo.report import per_class, print_epoch, progress_bar, progress_shown

__all__ = ["ddp_train"]


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


def _needs_join(counts: list[int], sizes: list[int]) -> bool:
    """Whether ranks run different numbers of steps per epoch, so ``Join`` must shadow the
    finished ranks' all-reduces. ``Join`` costs an extra all-reduce on every step of every rank
    (measured: 0.59x a raw DDP loop's samples/s with it, on 2 gloo processes), so a run whose
    ranks step alike goes without it."""
    steps = {-(-c // s) for c, s in zip(counts, sizes, strict=True)}
    return len(steps) > 1


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
    from torch.distributed.algorithms.join import Join
    from torch.utils.data import DataLoader

    from dataparallel.distributed import ShardedSampler, ddp_session, gather_all

    data = load_data(opts)
    epochs, batch_size, lr = resolve_hyper(data, opts)
    torch.manual_seed(opts.seed)
    net = build_model(data.input_shape, len(data.classes), trace=opts.trace)
    config = run_config(data, batch_size, opts, lr)
    with ddp_session(net) as (ddp, info):
        main, world, device = info.rank == 0, info.world_size, info.device
        counts, sizes = _rank_batches(len(data.train_y), world, batch_size)
        if min(sizes) < 1:
            raise UsageError(
                f"--batch-size: expected at least one sample per process ({world}), got "
                f"{batch_size}; use --batch-size {world} or more"
            )
        totals = _step_totals(counts, sizes)
        # How each step's loss is reduced (see backward below), decided once per run.
        scales = _loss_scales(counts, sizes, world)
        uneven = _needs_join(counts, sizes)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=opts.momentum)
        history: list[EpochStats] = []
        start_epoch = 0
        if opts.resume and opts.checkpoint:
            start_epoch, history = resume(
                opts.checkpoint, config, net, optimizer, out if main else None, epochs
            )
        sampler = ShardedSampler(data.train, shuffle=True, seed=opts.seed)
        loader = DataLoader(data.train, batch_size=sizes[info.rank], sampler=sampler)
        n = len(data.train_y)
        wall = time.perf_counter()
        trained, train_time = 0, 0.0
        last_samples, last_seconds = 0, 0.0
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            ddp.train()
            loss_sum, seen, t0 = 0.0, 0, time.perf_counter()
            # No bar object at all when none is shown (building one costs a tenth of a step).
            show = main and progress_shown(opts.progress)
            bar = progress_bar(n, f"epoch {epoch + 1}/{epochs}", True) if show else None
            # Join lets a rank with fewer batches shadow the others' gradient all-reduces; with
            # every rank stepping alike it would only add an all-reduce per step.
            with contextlib.ExitStack() as stack:
                if bar is not None:
                    stack.enter_context(contextlib.closing(bar))
                if uneven:
                    stack.enter_context(Join([ddp]))
                # The step does what a hand-written DDP loop does, plus a clock read: the
                # per-step figures of the report are kept as plain numbers.
                for k, (x, y) in enumerate(loader):
                    step_start = time.perf_counter()
                    x, y = x.to(device), y.to(device)
                    optimizer.zero_grad()
                    output = ddp(x)
                    scale = scales[k]
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
                        bar.set_postfix(loss=f"{value / samples:.4f}")
            seconds = time.perf_counter() - t0
            trained, train_time = trained + n, train_time + seconds
            sums = gather_all(torch.tensor([[loss_sum, seen]], dtype=torch.float64))
            # Every rank sees the same sums, so every rank stops here together.
            check_finite_loss(float(sums[:, 0].sum()), epoch + 1, None, lr)
            accuracy, classes = _ddp_evaluate(ddp.module, data, batch_size, opts.trace, device)
            stats = EpochStats(
                epoch + 1,
                float(sums[:, 0].sum() / sums[:, 1].sum()),
                accuracy,
                n / seconds,
                seconds,
            )
            history.append(stats)
            if main:
                if opts.checkpoint:  # written before the epoch's line, as in dp
                    save_checkpoint(
                        opts.checkpoint,
                        checkpoint_state(epoch + 1, net, optimizer, history, config),
                    )
                print_epoch(stats, epochs, out)
                if opts.checkpoint and epoch == start_epoch:  # where it wrote, once
                    print(checkpoint_message(opts.checkpoint, epoch + 1), file=out, flush=True)
        last = torch.tensor([[info.rank, last_samples, last_seconds]], dtype=torch.float64)
        loads = gather_all(last)
        accuracy, classes = _ddp_evaluate(ddp.module, data, batch_size, opts.trace, device)
        devices = [str(d) for d in gather_all([str(device)])]
    if not main:
        return None
    table = ["rank  samples  seconds"] + [
        f"{int(r):>4}  {int(s):>7}  {t:7.4f}" for r, s, t in loads.tolist()
    ]
    return TrainResult(
        data=data.spec,
        strategy="ddp",
        devices=devices,
        epochs=epochs,
        batch_size=batch_size,
        history=history,
        test_accuracy=accuracy,
        per_class=classes,
        samples_per_second=trained / train_time if train_time else 0.0,
        wall_seconds=time.perf_counter() - wall,
        last_step="\n".join(table),
        last_call={
            "devices": devices,
            "chunk_sizes": [int(s) for s in loads[:, 1].tolist()],
            "seconds": [float(t) for t in loads[:, 2].tolist()],
        },
    )


def _ddp_evaluate(
    net: nn.Module, data: DemoData, batch_size: int, trace: bool, device: torch.device
) -> tuple[float, list[tuple[str, int, int]]]:
    """Test accuracy overall and per class, each rank predicting its shard, gathered exactly."""
    from torch.utils.data import DataLoader

    from dataparallel.distributed import ShardedSampler, gather_all

    sampler = ShardedSampler(data.test, shuffle=False)
    preds, labels = [], []
    net.eval()
    net.trace = False  # type: ignore[assignment]
    try:
        with torch.no_grad():
            for x, y in DataLoader(data.test, batch_size=batch_size, sampler=sampler):
                preds.append(net(x.to(device)).argmax(dim=1).cpu())
                labels.append(y)
    finally:
        net.trace = trace  # type: ignore[assignment]
    empty = torch.empty(0, dtype=torch.long)
    local = (torch.cat(preds) if preds else empty, torch.cat(labels) if labels else empty)
    # Exact counts: every test sample once, whatever the ranks' shares.
    pred, label = gather_all(local)
    counts = per_class(pred, label, data.classes)
    total = len(label)
    return (sum(c for _, c, _ in counts) / total if total else 0.0), counts
