"""What ``dataparallel train`` was asked to do, and the figures it hands back.

The options and results dataclasses, the usage error and the resolution of options against a
dataset live here, apart from the loops, so that the dp loop (``train``), the ddp loop (``ddp``),
the checkpoints (``checkpoint``) and the report (``report``) can all share them without
importing each other in a cycle.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from dataparallel.app.demo.data import DataError, DemoData, load_dataset

__all__ = [
    "PLOT_FORMATS",
    "EpochStats",
    "RunClock",
    "TrainOptions",
    "TrainResult",
    "TrainingError",
    "UsageError",
    "check_finite_loss",
    "check_output_path",
    "check_outputs",
    "continue_restarted",
    "load_data",
    "resolve_hyper",
    "train_result",
]


PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")
"""The ``--plot`` suffixes: formats matplotlib's Agg canvas writes with what it installs."""


class UsageError(Exception):
    """A bad option or input: the command line prints the message on one line and exits 2.

    Under ddp, ``speaker`` says which rank prints it: ``"rank 0"`` (the default: every rank
    raised it alike, so rank 0 says it once), ``"self"`` (only some ranks raised it, say a
    checkpoint on one node's disk: the first of them says it, with its rank) or ``"nobody"``
    (another rank failed and says why; this one only ends, with the same exit code).
    """

    speaker: str = "rank 0"


class TrainingError(Exception):
    """Training cannot go on (the loss is no longer finite, or the disk cannot hold the next
    checkpoint): one line, exit code 3. The last complete checkpoint, if any, is kept as it
    was."""


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
    overwrite: bool = False  # replace an existing file at checkpoint (a new run, not --resume)
    plot: str | None = None
    json: str | None = None
    progress: bool | None = None  # None: a bar when stderr is a terminal
    # "none": the tutorial's net; "chunk": its variant with BatchNorm (per chunk under dp);
    # "sync": the same layers as SyncBatchNorm (--sync-bn: whole-batch statistics)
    batchnorm: str = "none"


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


@dataclasses.dataclass
class RunClock:
    """A run's clocks: the samples and seconds of its training epochs, and its wall time.

    Both loops (dp and ddp) count alike, so the report's samples/s means the same for both:
    training samples over training seconds (evaluation and checkpoints not counted).
    """

    start: float = dataclasses.field(default_factory=time.perf_counter)
    samples: int = 0
    seconds: float = 0.0

    def add(self, samples: int, seconds: float) -> None:
        """Count one training epoch."""
        self.samples += samples
        self.seconds += seconds


def train_result(
    data: DemoData,
    strategy: str,
    devices: list[str],
    hyper: tuple[int, int],
    history: list[EpochStats],
    scores: tuple[float, list[tuple[str, int, int]]],
    clock: RunClock,
    last: tuple[str, dict[str, Any] | None],
) -> TrainResult:
    """The figures of a run: ``hyper`` is ``(epochs, batch_size)``, ``scores`` the test
    accuracy and per-class counts, ``last`` the last step's text and record."""
    speed = clock.samples / clock.seconds if clock.seconds else 0.0
    wall = time.perf_counter() - clock.start
    return TrainResult(data.spec, strategy, devices, *hyper, history, *scores, speed, wall, *last)


def resolve_hyper(data: DemoData, opts: TrainOptions) -> tuple[int, int, float]:
    """The run's ``(epochs, batch_size, lr)``: the options where given, else the dataset's.

    Raises:
        UsageError: a batch size below 1, negative epochs, or ``--resume`` without a checkpoint.
    """
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


def load_data(opts: TrainOptions) -> DemoData:
    """Load ``opts.data``, turning a dataset error into a :class:`UsageError` for the CLI.

    Raises:
        UsageError: the dataset is unknown, missing or malformed.
    """
    try:
        return load_dataset(opts.data)
    except DataError as exc:
        raise UsageError(str(exc)) from exc


def check_output_path(option: str, path: str, *, replace: bool = False) -> None:
    """Check, before any work is done, that ``path`` can be written; create its folder.

    The check writes and removes a small file beside ``path`` (what the write will do), so it
    holds for read-only folders, a file where a folder should be, full disks and every user,
    root included. An existing ``path`` must be a file that can be opened for writing, unless
    ``replace`` (the file is replaced by a rename, as checkpoints are).

    Raises:
        UsageError: the path is a folder, or its folder cannot be created or written.
    """
    target = Path(path).expanduser()
    fix = f"fix: pass {option} a file path in a folder you can write"
    if target.is_dir():
        raise UsageError(f"{option} {path!r}: expected a file path, got a folder; {fix}")
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(
            f"{option} {path!r}: expected a path under a folder, got {str(existing)!r}, which "
            f"is a file; {fix}"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=target.parent)
        os.close(fd)
        os.unlink(probe)
        if target.exists() and not replace:
            with target.open("ab"):
                pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(
            f"{option} {path!r}: expected a writable path, got {reason!r} writing there; {fix}"
        ) from exc


# torchelastic's count of this job's worker restarts (0 at the first launch).
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def continue_restarted(opts: TrainOptions) -> TrainOptions:
    """``opts`` for a worker that torchrun restarted (``--max-restarts``) after a failure:
    where the job's ``--checkpoint`` file exists, the run continues from it, as ``--resume``
    would, instead of refusing its own checkpoint as another run's.

    At the first launch an existing file was refused (or, with ``--resume``, continued), so
    the file a restart finds is this job's own, the last complete epoch. Except after
    ``--overwrite``: the file may still be the replaced run's, if the first launch failed
    before its first epoch; such a job starts over (and replaces it), never silently
    continuing another run.
    """
    try:
        restarts = int(os.environ.get(RESTART_COUNT, "0"))
    except ValueError:
        return opts
    if restarts < 1 or opts.resume or opts.overwrite or not opts.checkpoint:
        return opts
    if not Path(opts.checkpoint).expanduser().is_file():
        return opts  # (failed before its first checkpoint: it starts again)
    return dataclasses.replace(opts, resume=True)


def check_outputs(opts: TrainOptions) -> None:
    """Check every output path of ``opts`` before the first epoch, so no run is lost at its end.

    Raises:
        UsageError: one of ``--checkpoint``, ``--json``, ``--plot`` cannot be written.
    """
    if opts.overwrite and (opts.resume or not opts.checkpoint):
        got = "--resume, which continues the file" if opts.resume else "no --checkpoint"
        raise UsageError(
            f"--overwrite: expected --checkpoint PATH of a new run, got {got}; fix: drop "
            f"--overwrite, or pass --checkpoint PATH without --resume"
        )
    if opts.checkpoint and not opts.resume and not opts.overwrite:
        _refuse_existing_checkpoint(opts.checkpoint)
    # A missing checkpoint to --resume from is reported by load_checkpoint, in its own words.
    if opts.checkpoint and not (opts.resume and not Path(opts.checkpoint).is_file()):
        check_output_path("--checkpoint", opts.checkpoint, replace=True)
    if opts.json:
        check_output_path("--json", opts.json)
    if opts.plot:
        check_plot_suffix(opts.plot)
        check_output_path("--plot", opts.plot)


def _refuse_existing_checkpoint(path: str) -> None:
    """A new run (no ``--resume``) never replaces a file silently: it may be another run's only
    copy of hours of training.

    Raises:
        UsageError: ``path`` exists (a folder is left to :func:`check_output_path`).
    """
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise UsageError(
            f"--checkpoint {path!r}: expected a path with no file yet (this run starts from "
            f"scratch), got an existing file, perhaps another run's checkpoint; fix: --resume "
            f"to continue it, --overwrite to replace it, or another path"
        )


def check_plot_suffix(path: str) -> None:
    """``--plot`` writes the format its suffix names, so the suffix must name one.

    Raises:
        UsageError: the suffix is not one of :data:`PLOT_FORMATS`.
    """
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        stem = Path(path).with_suffix("") if suffix else Path(path)
        raise UsageError(
            f"--plot {path!r}: expected a file name ending in "
            f"{', '.join('.' + f for f in PLOT_FORMATS)}, got "
            f"{repr('.' + suffix) if suffix else 'no suffix'}; fix: --plot {stem}.png"
        )


def check_finite_loss(loss: float, epoch: int, step: int | None, lr: float) -> None:
    """Stop a run whose loss is no longer finite, before it writes a checkpoint of it.

    Raises:
        TrainingError: ``loss`` is NaN or infinite.
    """
    if math.isfinite(loss):
        return
    where = f"epoch {epoch}" + ("" if step is None else f", step {step}")
    raise TrainingError(
        f"training: expected a finite loss, got {loss} at {where}; the run diverged, so it "
        f"stops here and keeps the last complete checkpoint; fix: lower --lr (was {lr:g})"
    )
