"""What ``dataparallel train`` was asked to do, and the figures it hands back.

The options and results dataclasses, the usage error and the resolution of options against a
dataset live here, apart from the loops, so that the dp loop (:mod:`dataparallel.demo.train`),
the ddp loop (:mod:`dataparallel.demo.ddp`), the checkpoints (:mod:`dataparallel.demo.checkpoint`)
and the report (:mod:`dataparallel.demo.report`) can all share them without importing each other
in a cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dataparallel.demo.data import DataError, DemoData, load_dataset

__all__ = [
    "EpochStats",
    "TrainOptions",
    "TrainResult",
    "UsageError",
    "load_data",
    "resolve_hyper",
]


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
