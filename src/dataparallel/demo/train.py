"""The training loop behind ``dataparallel train``: the tutorial's classifier on every device.

Two strategies share the data, the model, the checkpoints and the report:

- ``dp`` (one process): ``DataParallel(net, device_ids=devices)``; each batch is split over the
  replicas, the outputs are gathered and the loss is computed on the gathered output.
- ``ddp`` (one process per device, started by :func:`dataparallel.launch.launch` or torchrun):
  ``ddp_session`` wraps the model in ``DistributedDataParallel``, ``ShardedSampler`` partitions
  the training and test sets exactly, ``Join`` covers ranks with fewer steps, ``gather_all``
  brings every rank's predictions together for exact test counts, and rank 0 reports.

Runs are deterministic for a given seed: the model is initialised from ``--seed`` and each
epoch's order comes from ``(seed, epoch)``, so a run resumed from a checkpoint continues as if
it had never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from dataparallel.demo.data import DemoData, load_dataset
from dataparallel.demo.models import build_model

__all__ = [
    "CHECKPOINT_FORMAT",
    "CPU_REPLICAS",
    "EpochStats",
    "TrainOptions",
    "TrainResult",
    "UsageError",
    "auto_devices",
    "format_report",
    "load_checkpoint",
    "parse_devices",
    "run_train",
    "save_checkpoint",
    "train",
    "write_json",
    "write_plot",
]

CPU_REPLICAS = 1
"""CPU replicas used by ``--devices auto`` without CUDA (measured: see ``auto_devices``)."""

CHECKPOINT_FORMAT = "dataparallel-demo/1"


class UsageError(Exception):
    """A bad option or input: the command line prints the message on one line and exits 2."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """What ``dataparallel train`` was asked to do; ``None`` means the dataset's default."""

    data: str = "digits"
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    momentum: float = 0.9
    seed: int = 0
    devices: str = "auto"
    strategy: str = "dp"
    nproc_per_node: int = 1
    trace: bool = False
    checkpoint: str | None = None
    resume: bool = False
    plot: str | None = None
    json: str | None = None
    progress: bool | None = None  # None: a bar when stderr is a terminal


@dataclasses.dataclass(frozen=True)
class EpochStats:
    """One epoch's figures."""

    epoch: int
    loss: float
    test_accuracy: float
    samples_per_second: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The final figures of a run (rank 0's view under ddp)."""

    data: str
    strategy: str
    devices: list[str]
    epochs: int
    batch_size: int
    history: list[EpochStats]
    test_accuracy: float
    per_class: list[tuple[str, int, int]]  # (class name, correct, total)
    samples_per_second: float
    wall_seconds: float
    last_step: str  # str(model.last_call), or a note where there is none
    last_call: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the figures."""
        out = dataclasses.asdict(self)
        out["history"] = [dataclasses.asdict(h) for h in self.history]
        out["per_class"] = {
            name: {"correct": c, "total": t, "accuracy": c / t if t else None}
            for name, c, t in self.per_class
        }
        return out


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
        return resolve_devices(specs, where="--devices")
    except ValueError as exc:
        raise UsageError(f"{exc} (got --devices {text!r})") from exc


# ---------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a temp file in the same folder, fsync, replace.

    A crash mid-write leaves the previous checkpoint intact, never a truncated one.
    """
    target = Path(path)
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # Make the rename itself durable where the platform allows opening a folder.
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` (``weights_only=True``: no code runs).

    Raises:
        UsageError: the file is missing, unreadable, or not a checkpoint of this demo.
    """
    fix = "point --checkpoint at a file written by `dataparallel train`, or drop --resume"
    if not Path(path).is_file():
        raise UsageError(f"--checkpoint {str(path)!r}: no such file to resume from; {fix}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--checkpoint {str(path)!r}: cannot read it as a checkpoint ({reason}); {fix}"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise UsageError(
            f"--checkpoint {str(path)!r}: expected format {CHECKPOINT_FORMAT!r}, got {found!r}; "
            f"{fix}"
        )
    return state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _run_config(data: DemoData, batch_size: int, opts: TrainOptions, lr: float) -> dict[str, Any]:
    # What must match for a resumed run to continue the same run.
    return {
        "data": data.spec,
        "batch_size": batch_size,
        "seed": opts.seed,
        "lr": lr,
        "momentum": opts.momentum,
    }


def _check_resume(state: dict[str, Any], config: dict[str, Any], path: str) -> None:
    saved = state.get("config", {})
    for key, value in config.items():
        if saved.get(key) != value:
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"--resume: the checkpoint {path!r} was written with {flag} "
                f"{saved.get(key)!r}, got {value!r}; resume with the same {flag}"
            )


def _resume(
    path: str,
    config: dict[str, Any],
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    out: TextIO | None,
) -> tuple[int, list[EpochStats]]:
    """Load a checkpoint into ``net`` and ``optimizer``; return the epochs done and history."""
    state = load_checkpoint(path)
    _check_resume(state, config, path)
    try:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        epoch = int(state["epoch"])
        history = [EpochStats(**h) for h in state["history"]]
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--checkpoint {path!r}: does not fit this model and options ({reason}); "
            f"resume with the options it was written with, or start without --resume"
        ) from exc
    if out is not None:
        print(f"resumed from {path} after epoch {epoch}", file=out)
    return epoch, history


def _checkpoint_state(
    epoch: int,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    history: list[EpochStats],
    config: dict[str, Any],
) -> dict[str, Any]:
    return {
        "format": CHECKPOINT_FORMAT,
        "epoch": epoch,
        "model": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(),
        "history": [dataclasses.asdict(h) for h in history],
        "config": config,
    }


# ---------------------------------------------------------------------------------- loops


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    # Each epoch's order depends on (seed, epoch) alone, so a resumed run sees the same order;
    # seed + epoch is ShardedSampler's rule too, so one-process ddp sees dp's batches.
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=gen)


def _batches(n: int, batch_size: int) -> Iterator[slice]:
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def _bar(total: int, desc: str, enabled: bool | None) -> Any:
    from tqdm import tqdm

    class _Bar(tqdm):
        # tqdm's monitor is a process-wide thread that outlives the run; a demo bar that is
        # updated every step does not need it.
        monitor_interval = 0

    show = sys.stderr.isatty() if enabled is None else enabled
    return _Bar(
        total=total, desc=desc, unit="sample", leave=False, dynamic_ncols=True, disable=not show
    )


def _per_class(
    preds: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]
) -> list[tuple[str, int, int]]:
    k = len(classes)
    total = torch.bincount(labels, minlength=k)
    correct = torch.bincount(labels[preds == labels], minlength=k)
    return [(classes[i], int(correct[i]), int(total[i])) for i in range(k)]


def _last_call_dict(call: Any) -> dict[str, Any] | None:
    if call is None:
        return None
    return {
        "devices": [str(d) for d in call.devices],
        "chunk_sizes": [int(c) for c in call.chunk_sizes],
        "seconds": [float(s) for s in call.seconds],
    }


def _resolve_hyper(data: DemoData, opts: TrainOptions) -> tuple[int, int, float]:
    epochs = data.epochs if opts.epochs is None else opts.epochs
    batch_size = data.batch_size if opts.batch_size is None else opts.batch_size
    lr = data.lr if opts.lr is None else opts.lr
    if batch_size < 1:
        raise UsageError(f"--batch-size: expected an integer >= 1, got {batch_size!r}")
    if epochs < 0:
        raise UsageError(f"--epochs: expected an integer >= 0, got {epochs!r}")
    if opts.resume and not opts.checkpoint:
        raise UsageError("--resume: expected --checkpoint PATH to resume from, got none")
    return epochs, batch_size, lr


def _load(opts: TrainOptions) -> DemoData:
    from dataparallel.demo.data import DataError

    try:
        return load_dataset(opts.data)
    except DataError as exc:
        raise UsageError(str(exc)) from exc


def _dp_train(opts: TrainOptions, out: TextIO) -> TrainResult:
    data = _load(opts)
    epochs, batch_size, lr = _resolve_hyper(data, opts)
    devices = parse_devices(opts.devices)
    from dataparallel.wrapper import DataParallel

    torch.manual_seed(opts.seed)
    net = build_model(data.input_shape, len(data.classes), trace=opts.trace).to(devices[0])
    model = DataParallel(net, device_ids=devices)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=opts.momentum)
    criterion = nn.CrossEntropyLoss()
    config = _run_config(data, batch_size, opts, lr)
    history: list[EpochStats] = []
    start_epoch = 0
    if opts.resume and opts.checkpoint:
        start_epoch, history = _resume(opts.checkpoint, config, net, optimizer, out)

    def predict(x: torch.Tensor) -> torch.Tensor:
        return model(x).argmax(dim=1).cpu()

    n = len(data.train_y)
    wall = time.perf_counter()
    trained, train_time = 0, 0.0
    last_step, last_call = "no training step ran in this run", None
    for epoch in range(start_epoch, epochs):
        net.train()
        order = _epoch_order(n, opts.seed, epoch)
        loss_sum, t0 = 0.0, time.perf_counter()
        with contextlib.closing(_bar(n, f"epoch {epoch + 1}/{epochs}", opts.progress)) as bar:
            for part in _batches(n, batch_size):
                idx = order[part]
                x, y = data.train_x[idx], data.train_y[idx]
                optimizer.zero_grad()
                output = model(x)
                if opts.trace:
                    print("Outside: input size", x.size(), "output_size", output.size(), file=out)
                loss = criterion(output, y.to(output.device))
                loss.backward()
                optimizer.step()
                loss_sum += loss.item() * len(idx)
                bar.update(len(idx))
                bar.set_postfix(loss=f"{loss.item():.4f}")  # tqdm shows samples/s itself
        seconds = time.perf_counter() - t0
        trained, train_time = trained + n, train_time + seconds
        call = model.last_call
        last_step = str(call) if call is not None else "(DataParallel kept no record)"
        last_call = _last_call_dict(call)
        accuracy, _ = _evaluate(net, predict, data, batch_size, opts.trace)
        stats = EpochStats(epoch + 1, loss_sum / n, accuracy, n / seconds, seconds)
        history.append(stats)
        _print_epoch(stats, epochs, out)
        if opts.checkpoint:
            save_checkpoint(
                opts.checkpoint, _checkpoint_state(epoch + 1, net, optimizer, history, config)
            )
    accuracy, per_class = _evaluate(net, predict, data, batch_size, opts.trace)
    return TrainResult(
        data=data.spec,
        strategy="dp",
        devices=[str(d) for d in devices],
        epochs=epochs,
        batch_size=batch_size,
        history=history,
        test_accuracy=accuracy,
        per_class=per_class,
        samples_per_second=trained / train_time if train_time else 0.0,
        wall_seconds=time.perf_counter() - wall,
        last_step=last_step,
        last_call=last_call,
    )


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
    per_class = _per_class(pred, data.test_y, data.classes)
    total = len(data.test_y)
    return (sum(c for _, c, _ in per_class) / total if total else 0.0), per_class


def _print_epoch(stats: EpochStats, epochs: int, out: TextIO) -> None:
    print(
        f"epoch {stats.epoch}/{epochs}: loss {stats.loss:.4f}, test accuracy "
        f"{stats.test_accuracy:.4f}, {stats.samples_per_second:.0f} samples/s, "
        f"{stats.seconds:.1f} s",
        file=out,
        flush=True,
    )


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


def _ddp_train(opts: TrainOptions, out: TextIO) -> TrainResult | None:
    import torch.nn.functional as F
    from torch.distributed.algorithms.join import Join
    from torch.utils.data import DataLoader

    from dataparallel.distributed import ShardedSampler, ddp_session, gather_all

    data = _load(opts)
    epochs, batch_size, lr = _resolve_hyper(data, opts)
    torch.manual_seed(opts.seed)
    net = build_model(data.input_shape, len(data.classes), trace=opts.trace)
    config = _run_config(data, batch_size, opts, lr)
    with ddp_session(net) as (ddp, info):
        main, world, device = info.rank == 0, info.world_size, info.device
        counts, sizes = _rank_batches(len(data.train_y), world, batch_size)
        if min(sizes) < 1:
            raise UsageError(
                f"--batch-size: expected at least one sample per process ({world}), got "
                f"{batch_size}; use --batch-size {world} or more"
            )
        totals = _step_totals(counts, sizes)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=opts.momentum)
        history: list[EpochStats] = []
        start_epoch = 0
        if opts.resume and opts.checkpoint:
            start_epoch, history = _resume(
                opts.checkpoint, config, net, optimizer, out if main else None
            )
        sampler = ShardedSampler(data.train, shuffle=True, seed=opts.seed)
        loader = DataLoader(data.train, batch_size=sizes[info.rank], sampler=sampler)
        n = len(data.train_y)
        wall = time.perf_counter()
        trained, train_time = 0, 0.0
        last = torch.zeros(1, 3, dtype=torch.float64)
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            ddp.train()
            loss_sum, seen, t0 = 0.0, 0, time.perf_counter()
            bar = _bar(n, f"epoch {epoch + 1}/{epochs}", opts.progress if main else False)
            # Join lets a rank with fewer batches shadow the others' gradient all-reduces.
            with contextlib.closing(bar), Join([ddp]):
                for k, (x, y) in enumerate(loader):
                    step_start = time.perf_counter()
                    x, y = x.to(device), y.to(device)
                    optimizer.zero_grad()
                    output = ddp(x)
                    summed = F.cross_entropy(output, y, reduction="sum")
                    # DDP averages gradients over ranks; scaling by world / global batch makes
                    # that average the global batch's mean, even when ranks' batches differ.
                    (summed * world / totals[k]).backward()
                    optimizer.step()
                    loss_sum, seen = loss_sum + summed.item(), seen + len(y)
                    last = torch.tensor(
                        [[info.rank, len(y), time.perf_counter() - step_start]],
                        dtype=torch.float64,
                    )
                    bar.update(totals[k])
                    bar.set_postfix(loss=f"{summed.item() / len(y):.4f}")
            seconds = time.perf_counter() - t0
            trained, train_time = trained + n, train_time + seconds
            sums = gather_all(torch.tensor([[loss_sum, seen]], dtype=torch.float64))
            accuracy, per_class = _ddp_evaluate(ddp.module, data, batch_size, opts.trace, device)
            stats = EpochStats(
                epoch + 1,
                float(sums[:, 0].sum() / sums[:, 1].sum()),
                accuracy,
                n / seconds,
                seconds,
            )
            history.append(stats)
            if main:
                _print_epoch(stats, epochs, out)
                if opts.checkpoint:
                    save_checkpoint(
                        opts.checkpoint,
                        _checkpoint_state(epoch + 1, net, optimizer, history, config),
                    )
        loads = gather_all(last)
        accuracy, per_class = _ddp_evaluate(ddp.module, data, batch_size, opts.trace, device)
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
        per_class=per_class,
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
    per_class = _per_class(pred, label, data.classes)
    total = len(label)
    return (sum(c for _, c, _ in per_class) / total if total else 0.0), per_class


# --------------------------------------------------------------------------------- output


def format_report(result: TrainResult) -> str:
    """The end-of-run summary: accuracy overall and per class, throughput, last step's load."""
    correct = sum(c for _, c, _ in result.per_class)
    total = sum(t for _, _, t in result.per_class)
    width = max([len("class"), *(len(name) for name, _, _ in result.per_class)])
    lines = [
        f"test accuracy {result.test_accuracy:.4f} ({correct}/{total}) after {result.epochs} "
        f"epochs, {result.strategy} on {', '.join(result.devices)}, batch {result.batch_size}",
        f"{'class':<{width}}  accuracy  correct  total",
    ]
    for name, c, t in result.per_class:
        acc = f"{c / t:.4f}" if t else "-"
        lines.append(f"{name:<{width}}  {acc:>8}  {c:>7}  {t:>5}")
    lines.append(
        f"training: {result.samples_per_second:.0f} samples/s; wall time "
        f"{result.wall_seconds:.1f} s"
    )
    lines.append("last step, per replica:")
    lines.append(result.last_step)
    return "\n".join(lines)


def write_json(path: str, result: TrainResult) -> None:
    """The final figures as JSON, for machines."""
    text = json.dumps(result.to_json(), indent=2) + "\n"
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")


def write_plot(path: str, history: Sequence[EpochStats]) -> None:
    """A PNG of the training loss and test accuracy per epoch (matplotlib, Agg canvas).

    Raises:
        UsageError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UsageError(
            "--plot: needs matplotlib, which is not installed; install it with "
            "`pip install dataparallel[plot]`, or drop --plot"
        ) from exc
    # A bare Figure on the Agg canvas: no pyplot, no global backend switch.
    fig = Figure(figsize=(8, 3.2))
    FigureCanvasAgg(fig)
    epochs = [h.epoch for h in history]
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, [h.loss for h in history], marker="o")
    ax_loss.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    ax_acc.plot(epochs, [h.test_accuracy for h in history], marker="o", color="tab:green")
    ax_acc.set(title="test accuracy", xlabel="epoch", ylabel="accuracy", ylim=(0, 1.02))
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png", dpi=100)


# ---------------------------------------------------------------------------------- entry


def _in_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _check_options(opts: TrainOptions) -> None:
    if opts.strategy not in ("dp", "ddp"):
        raise UsageError(f"--strategy: expected dp or ddp, got {opts.strategy!r}")
    if opts.strategy == "ddp" and opts.devices != "auto":
        raise UsageError(
            f"--devices: applies to --strategy dp; ddp runs one process per device (its "
            f"LOCAL_RANK), got --devices {opts.devices!r}; drop --devices or use --strategy dp"
        )
    if opts.strategy == "dp" and opts.nproc_per_node != 1:
        raise UsageError(
            f"--nproc-per-node: applies to --strategy ddp, got {opts.nproc_per_node!r} with dp; "
            f"add --strategy ddp or drop --nproc-per-node"
        )
    if opts.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise UsageError(
                "--plot: needs matplotlib, which is not installed; install it with "
                "`pip install dataparallel[plot]`, or drop --plot"
            ) from exc


def train(opts: TrainOptions, out: TextIO | None = None) -> TrainResult | None:
    """Train in this process with ``opts.strategy`` and return the figures (``None`` on ranks
    other than 0 under ddp). Does not print the final report; see :func:`run_train`.

    Raises:
        UsageError: a bad option, dataset or checkpoint.
    """
    _check_options(opts)
    stream = sys.stdout if out is None else out
    if opts.strategy == "ddp":
        return _ddp_train(opts, stream)
    return _dp_train(opts, stream)


def run_train(opts: TrainOptions, argv: Sequence[str], out: TextIO | None = None) -> int:
    """``dataparallel train``: train, report, write ``--json`` and ``--plot``; the exit code.

    Under ``--strategy ddp --nproc-per-node N`` (N > 1) outside torchrun, the options are
    checked here (so a bad one is reported once), then ``python -m dataparallel <argv>`` runs
    in N workers through :func:`dataparallel.launch.launch`.
    """
    stream = sys.stdout if out is None else out
    _check_options(opts)
    if opts.strategy == "ddp" and opts.nproc_per_node > 1 and not _in_torchrun():
        data = _load(opts)
        _resolve_hyper(data, opts)
        if opts.resume and opts.checkpoint:
            load_checkpoint(opts.checkpoint)
        from dataparallel.launch import launch

        return launch(list(argv), nproc_per_node=opts.nproc_per_node)
    result = train(opts, stream)
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
