"""The training loop behind ``dataparallel train``: the tutorial's classifier on every device.

This module holds the command's entry points (:func:`train`, :func:`run_train`), the parsing of
``--devices`` and the ``dp`` strategy's loop; the other parts live beside it:

- ``dp`` (one process, here): ``DataParallel(net, device_ids=devices)``; each batch is split
  over the replicas, the outputs are gathered and the loss is computed on the gathered output.
- ``ddp`` (one process per device): :mod:`dataparallel.app.demo.ddp`.
- options and results: :mod:`dataparallel.app.demo.options`; checkpoints and resuming:
  :mod:`dataparallel.app.demo.checkpoint`; progress and the final report:
  :mod:`dataparallel.app.demo.report`.

Runs are deterministic for a given seed: the model is initialised from ``--seed`` and each
epoch's order comes from ``(seed, epoch)``, so a run resumed from a checkpoint continues as if
it had never stopped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import torch
from torch import nn

from dataparallel.app.demo.checkpoint import (
    checkpoint_state,
    end_epoch,
    load_checkpoint,
    resume,
    run_config,
)
from dataparallel.app.demo.data import DemoData
from dataparallel.app.demo.ddp import check_batchnorm_batches, ddp_train
from dataparallel.app.demo.models import build_model
from dataparallel.app.demo.options import (
    EpochStats,
    RunClock,
    TrainOptions,
    TrainResult,
    UsageError,
    check_finite_loss,
    check_outputs,
    continue_restarted,
    load_data,
    resolve_hyper,
    train_result,
)
from dataparallel.app.demo.report import (
    format_report,
    per_class,
    progress_bar,
    require_matplotlib,
    write_json,
    write_plot,
)

__all__ = [
    "CPU_REPLICAS",
    "auto_devices",
    "parse_devices",
    "run_train",
    "train",
]

CPU_REPLICAS = 1
"""CPU replicas used by ``--devices auto`` without CUDA (measured: see ``auto_devices``)."""


# -------------------------------------------------------------------------------- devices


def auto_devices() -> list[torch.device]:
    """Every CUDA device; without CUDA, ``CPU_REPLICAS`` replicas on the CPU.

    One CPU replica is the default: on a 2-core machine two CPU replicas of this small model
    were measured slower than one (the replicas compete for the same cores that one replica's
    intra-op threads already use).
    """
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * CPU_REPLICAS


def parse_devices(text: str) -> list[torch.device]:
    """``"auto"``, or a comma list such as ``"cpu,cpu"`` or ``"0,1"`` (ints are CUDA indices).

    Raises:
        UsageError: an entry is not a usable device.
    """
    if text.strip() == "auto":
        return auto_devices()
    from dataparallel.devices import resolve_devices

    specs: list[int | str] = []
    for raw in text.split(","):
        item = raw.strip()
        specs.append(int(item) if item.isdigit() else item)
    try:
        devices = resolve_devices(specs, where="--devices")
    except ValueError as exc:
        raise UsageError(f"{exc} (got --devices {text!r})") from exc
    for i, device in enumerate(devices):
        # The library takes 'cpu:1' as a second CPU device (a testing trick) and 'meta' for
        # shapes only; neither can train: the model lives on plain 'cpu' and meta holds no data.
        if device.type == "meta":
            raise UsageError(
                f"--devices[{i}]: expected a device that holds data (cpu or a CUDA index), got "
                f"'meta'; fix: --devices cpu, or --devices 0,1 for GPUs"
            )
        if device.type == "cpu" and device.index is not None:
            raise UsageError(
                f"--devices[{i}]: expected 'cpu' (the CPU has no index), got {str(device)!r}; "
                f"fix: repeat cpu for more replicas, e.g. --devices cpu,cpu"
            )
    return devices


# ---------------------------------------------------------------------------------- loops


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    # Each epoch's order depends on (seed, epoch) alone, so a resumed run sees the same order;
    # seed + epoch is ShardedSampler's rule too, so one-process ddp sees dp's batches.
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=gen)


def _batches(n: int, batch_size: int) -> Iterator[slice]:
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def _last_call_dict(call: Any) -> dict[str, Any] | None:
    if call is None:
        return None
    return {
        "devices": [str(d) for d in call.devices],
        "chunk_sizes": [int(c) for c in call.chunk_sizes],
        "seconds": [float(s) for s in call.seconds],
    }


def _dp_train(opts: TrainOptions, out: TextIO) -> TrainResult:
    data = load_data(opts)
    epochs, batch_size, lr = resolve_hyper(data, opts)
    devices = parse_devices(opts.devices)
    from dataparallel.wrapper import DataParallel

    torch.manual_seed(opts.seed)
    net = build_model(
        data.input_shape, len(data.classes), trace=opts.trace, batchnorm=opts.batchnorm
    ).to(devices[0])
    model = DataParallel(net, device_ids=devices)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=opts.momentum)
    criterion = nn.CrossEntropyLoss()
    config = run_config(data, batch_size, opts, lr)
    history: list[EpochStats] = []
    start_epoch = 0
    if opts.resume and opts.checkpoint:
        start_epoch, history = resume(opts.checkpoint, config, net, optimizer, out, epochs)

    def predict(x: torch.Tensor) -> torch.Tensor:
        return model(x).argmax(dim=1).cpu()

    n = len(data.train_y)
    clock = RunClock()
    last_step, last_call = "no training step ran in this run", None
    for epoch in range(start_epoch, epochs):
        net.train()
        order = _epoch_order(n, opts.seed, epoch)
        loss_sum, t0 = 0.0, time.perf_counter()
        with contextlib.closing(
            progress_bar(n, f"epoch {epoch + 1}/{epochs}", opts.progress)
        ) as bar:
            for step, part in enumerate(_batches(n, batch_size), start=1):
                idx = order[part]
                x, y = data.train_x[idx], data.train_y[idx]
                optimizer.zero_grad()
                output = model(x)
                if opts.trace:
                    print("Outside: input size", x.size(), "output_size", output.size(), file=out)
                loss = criterion(output, y.to(output.device))
                value = loss.item()
                check_finite_loss(value, epoch + 1, step, lr)  # before the step spoils the model
                loss.backward()
                optimizer.step()
                loss_sum += value * len(idx)
                bar.update(len(idx))
                bar.set_postfix(loss=f"{value:.4f}")  # tqdm shows samples/s itself
        seconds = time.perf_counter() - t0
        clock.add(n, seconds)
        call = model.last_call
        last_step = str(call) if call is not None else "(DataParallel kept no record)"
        last_call = _last_call_dict(call)
        accuracy, _ = _evaluate(net, predict, data, batch_size, opts.trace)
        stats = EpochStats(epoch + 1, loss_sum / n, accuracy, n / seconds, seconds)
        history.append(stats)
        end_epoch(
            stats,
            epochs,
            out,
            opts.checkpoint,
            functools.partial(checkpoint_state, epoch + 1, net, optimizer, history, config),
            first=epoch == start_epoch,
        )
    scores = _evaluate(net, predict, data, batch_size, opts.trace)
    hyper = (epochs, batch_size)
    names = [str(d) for d in devices]
    return train_result(data, "dp", names, hyper, history, scores, clock, (last_step, last_call))


def _evaluate(
    net: nn.Module,
    predict: Callable[[torch.Tensor], torch.Tensor],
    data: DemoData,
    batch_size: int,
    trace: bool,
) -> tuple[float, list[tuple[str, int, int]]]:
    # Tracing shows the training steps only, as in the tutorial's loop.
    net.eval()
    net.trace = False  # type: ignore[assignment]
    try:
        with torch.no_grad():
            preds = [predict(data.test_x[p]) for p in _batches(len(data.test_y), batch_size)]
    finally:
        net.trace = trace  # type: ignore[assignment]
    pred = torch.cat(preds) if preds else torch.empty(0, dtype=torch.long)
    counts = per_class(pred, data.test_y, data.classes)
    total = len(data.test_y)
    return (sum(c for _, c, _ in counts) / total if total else 0.0), counts


# ---------------------------------------------------------------------------------- entry


def _in_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _check_options(opts: TrainOptions) -> None:
    if opts.strategy not in ("dp", "ddp"):
        raise UsageError(f"--strategy: expected dp or ddp, got {opts.strategy!r}")
    if opts.strategy == "ddp" and opts.devices not in ("auto", "cpu"):
        raise UsageError(
            f"--devices: under --strategy ddp, expected auto (one process per GPU, its "
            f"LOCAL_RANK; the CPU where there is none) or cpu (every process on the CPU, gloo), "
            f"got --devices {opts.devices!r}; use one of those, or --strategy dp for a list"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if opts.strategy == "ddp" and opts.devices == "auto" and 0 < gpus < opts.nproc_per_node:
        raise UsageError(
            f"--nproc-per-node: ddp on GPUs runs one process per GPU, and this machine has "
            f"{gpus}, got --nproc-per-node {opts.nproc_per_node}; use --nproc-per-node {gpus}, "
            f"or add --devices cpu to run {opts.nproc_per_node} processes on the CPU (gloo)"
        )
    if opts.strategy == "dp" and opts.nproc_per_node != 1:
        raise UsageError(
            f"--nproc-per-node: applies to --strategy ddp, got {opts.nproc_per_node!r} with dp; "
            f"add --strategy ddp or drop --nproc-per-node"
        )
    if opts.strategy == "ddp" and opts.batchnorm == "sync" and (not gpus or opts.devices == "cpu"):
        # torch's DistributedDataParallel refuses SyncBatchNorm on CPU modules: say so first.
        raise UsageError(
            "--sync-bn: under --strategy ddp, SyncBatchNorm is torch's, which synchronises "
            "through the process group on GPUs only, and this run has none; use "
            "--strategy dp --devices cpu,cpu (the replicas of one process synchronise on the "
            "CPU), or --batchnorm"
        )
    if opts.strategy == "ddp":
        # Every rank reads it when it meets the others: a bad value is a usage error here, in
        # one line, not a traceback from each worker after the launch.
        from dataparallel.distributed import resolve_timeout

        try:
            resolve_timeout(None)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if opts.plot:
        require_matplotlib()
    check_outputs(opts)


def train(opts: TrainOptions, out: TextIO | None = None) -> TrainResult | None:
    """Train in this process with ``opts.strategy`` and return the figures (``None`` on ranks
    other than 0 under ddp). Does not print the final report; see :func:`run_train`.

    Raises:
        UsageError: a bad option, dataset or checkpoint.
    """
    opts = continue_restarted(opts)
    _check_options(opts)
    stream = sys.stdout if out is None else out
    if opts.strategy == "ddp":
        return ddp_train(opts, stream)
    return _dp_train(opts, stream)


def run_train(opts: TrainOptions, argv: Sequence[str], out: TextIO | None = None) -> int:
    """``dataparallel train``: train, report, write ``--json`` and ``--plot``; the exit code.

    Under ``--strategy ddp --nproc-per-node N`` (N > 1) outside torchrun, the options are
    checked here (so a bad one is reported once), then ``python -m dataparallel <argv>`` runs
    in N workers through :func:`dataparallel.app.launch.launch`.
    """
    stream = sys.stdout if out is None else out
    opts = continue_restarted(opts)  # a worker torchrun restarted continues its checkpoint
    _check_options(opts)
    try:
        if opts.strategy == "ddp" and opts.nproc_per_node > 1 and not _in_torchrun():
            data = load_data(opts)
            batch_size = resolve_hyper(data, opts)[1]
            n, world = len(data.train_y), opts.nproc_per_node
            check_batchnorm_batches(n, world, batch_size, opts.batchnorm)  # one line, not N
            if opts.resume and opts.checkpoint:
                load_checkpoint(opts.checkpoint)
            from dataparallel.app.launch import launch

            return launch(list(argv), nproc_per_node=opts.nproc_per_node)
        result = train(opts, stream)
    except KeyboardInterrupt as exc:
        if opts.checkpoint and os.path.isfile(opts.checkpoint):
            what = [str(exc)] if str(exc) else []  # (which worker, under ddp)
            kept = f"{opts.checkpoint} keeps the last complete epoch; continue with --resume"
            raise KeyboardInterrupt("; ".join([*what, kept])) from None
        raise
    if result is None:
        return 0
    print(format_report(result), file=stream, flush=True)
    if opts.json:
        write_json(opts.json, result)
        print(f"figures written to {opts.json}", file=stream)
    if opts.plot:
        write_plot(opts.plot, result.history)
        print(f"plot written to {opts.plot}", file=stream)
    return 0
