"""What ``dataparallel train`` shows and writes: progress, per-epoch lines and the final report.

The per-class accuracy counts, the progress bar, the per-epoch line, the end-of-run summary and
the ``--json`` and ``--plot`` files live here, apart from the loops, so that the dp and ddp
strategies report in exactly the same form.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from dataparallel.app.demo.options import EpochStats, TrainResult, UsageError

__all__ = [
    "format_report",
    "per_class",
    "print_epoch",
    "progress_bar",
    "progress_shown",
    "require_matplotlib",
    "write_json",
    "write_plot",
]


def per_class(
    preds: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]
) -> list[tuple[str, int, int]]:
    """``(class name, correct, total)`` for each class, from predicted and true labels."""
    k = len(classes)
    total = torch.bincount(labels, minlength=k)
    correct = torch.bincount(labels[preds == labels], minlength=k)
    return [(classes[i], int(correct[i]), int(total[i])) for i in range(k)]


def progress_shown(enabled: bool | None) -> bool:
    """Whether a bar is drawn: ``enabled``, or for ``None`` whether stderr is a terminal."""
    return sys.stderr.isatty() if enabled is None else enabled


@functools.cache
def _bar_class() -> Any:
    """tqdm without its monitor, made once (a class made per bar is work and garbage)."""
    from tqdm import tqdm

    class _Bar(tqdm):
        # tqdm's monitor is a process-wide thread that outlives the run; a demo bar that is
        # updated every step does not need it.
        monitor_interval = 0

    return _Bar


def progress_bar(total: int, desc: str, enabled: bool | None) -> Any:
    """A tqdm bar over ``total`` samples; ``enabled=None`` shows it when stderr is a terminal."""
    return _bar_class()(
        total=total,
        desc=desc,
        unit="sample",
        leave=False,
        dynamic_ncols=True,
        disable=not progress_shown(enabled),
    )


def print_epoch(stats: EpochStats, epochs: int, out: TextIO) -> None:
    """Print one epoch's line: loss, test accuracy, throughput and time."""
    print(
        f"epoch {stats.epoch}/{epochs}: loss {stats.loss:.4f}, test accuracy "
        f"{stats.test_accuracy:.4f}, {stats.samples_per_second:.0f} samples/s, "
        f"{stats.seconds:.1f} s",
        file=out,
        flush=True,
    )


def format_report(result: TrainResult) -> str:
    """The end-of-run summary: accuracy overall and per class, throughput, last step's load."""
    correct = sum(c for _, c, _ in result.per_class)
    total = sum(t for _, _, t in result.per_class)
    width = max([len("class"), *(len(name) for name, _, _ in result.per_class)])
    done = len(result.history)  # the epochs the model has had, resumed ones included
    lines = [
        f"test accuracy {result.test_accuracy:.4f} ({correct}/{total}) after {done} "
        f"epoch{'' if done == 1 else 's'}, {result.strategy} on {', '.join(result.devices)}, "
        f"batch {result.batch_size}",
        f"{'class':<{width}}  accuracy  correct  total",
    ]
    for name, c, t in result.per_class:
        acc = f"{c / t:.4f}" if t else "-"
        lines.append(f"{name:<{width}}  {acc:>8}  {c:>7}  {t:>5}")
    if not result.samples_per_second:  # no epoch ran in this run (a finished run resumed)
        why = f"the checkpoint already held {done} epochs" if done else "--epochs 0"
        lines.append(f"training: none in this run ({why}); wall time {result.wall_seconds:.1f} s")
        return "\n".join(lines)
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


def require_matplotlib() -> None:
    """Fail early and clearly when ``--plot`` is asked for without matplotlib.

    Raises:
        UsageError: matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            "--plot: expected matplotlib (it draws the plot), got none installed; "
            "fix: pip install 'dataparallel[plot]', or drop --plot"
        ) from exc


def write_plot(path: str, history: Sequence[EpochStats]) -> None:
    """A plot of the training loss and test accuracy per epoch (matplotlib, Agg canvas), in the
    format the suffix of ``path`` names (``.png``, ``.pdf``, ``.svg``, ``.jpg``).

    Raises:
        UsageError: matplotlib is not installed.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

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
    # The suffix names the format (checked before the run by check_plot_suffix).
    fig.savefig(target, format=target.suffix.lower().lstrip(".") or "png", dpi=100)
