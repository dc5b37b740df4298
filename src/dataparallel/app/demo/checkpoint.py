"""Checkpoints of ``dataparallel train``: atomic writes, safe reads, and resuming a run.

A checkpoint holds the model, the optimizer, the RNG state, the history so far and the options
that must match for a resumed run to continue the same run. Both strategies (dp and ddp) write
and resume through this module, so a run resumed from a checkpoint continues as if it had never
stopped, whichever loop wrote it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import tempfile
from collections.abc import Callable
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from dataparallel._common.digest import digest_damage, with_digest, zip_damage
from dataparallel.app.demo.data import DemoData
from dataparallel.app.demo.options import EpochStats, TrainingError, TrainOptions, UsageError
from dataparallel.app.demo.report import print_epoch

__all__ = [
    "CHECKPOINT_FORMAT",
    "check_resume",
    "checkpoint_message",
    "checkpoint_state",
    "end_epoch",
    "load_checkpoint",
    "resume",
    "resume_message",
    "rng_state",
    "run_config",
    "save_checkpoint",
    "set_rng_state",
]

CHECKPOINT_FORMAT = "dataparallel-demo/1"


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a temp file in the same folder, fsync, replace.

    A crash mid-write leaves the previous checkpoint intact, never a truncated one; the temp
    files that such a crash (or a ``SIGKILL``) leaves behind are removed by the next write.
    The file carries the SHA-256 of its contents (``"checksum"``), which
    :func:`load_checkpoint` checks before a resume.
    """
    target = Path(path)
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(with_digest(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _remove_stale_temps(target)
    # Make the rename itself durable where the platform allows opening a folder.
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _temp_name_pattern(target: Path) -> re.Pattern[str]:
    """The names ``save_checkpoint`` gives ``target``'s temp files, and no other target's.

    ``mkstemp`` names them ``.{name}.{random}.tmp`` with a random part free of dots, so the part
    between the target's own prefix and ``.tmp`` is one dot-free word. A glob such as
    ``.run.pt.*.tmp`` would also match ``.run.pt.1.{random}.tmp``, the temp file of another
    checkpoint (``run.pt.1``) that another run may be writing at this very moment.
    """
    return re.compile(rf"\.{re.escape(target.name)}\.[A-Za-z0-9_]+\.tmp")


def _remove_stale_temps(target: Path) -> None:
    # Temp files of earlier writes of this same checkpoint that never reached os.replace (the
    # process was killed mid-write). Only this target's own temp names are touched: another
    # checkpoint's temp file in the same folder (run.pt.1 beside run.pt) is never removed.
    pattern = _temp_name_pattern(target)
    for stale in target.parent.glob(f".{glob_escape(target.name)}.*.tmp"):
        if pattern.fullmatch(stale.name):
            with contextlib.suppress(OSError):
                stale.unlink()


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` (``weights_only=True``: no code runs).

    A damaged file is refused before any of it is used: each record against the CRC-32 the zip
    holds for it, then the contents against the SHA-256 written with them. A checkpoint written
    before the SHA-256 was (issue 63) has none, and is checked by its CRC-32s alone.

    Raises:
        UsageError: the file is missing, unreadable, damaged, or not a checkpoint of this demo.
    """
    fix = "fix: point --checkpoint at a file written by `dataparallel train`, or drop --resume"
    if not Path(path).is_file():
        raise UsageError(f"--checkpoint {str(path)!r}: no such file to resume from; {fix}")
    damage = zip_damage(path)
    if damage is not None:
        raise UsageError(_damaged(path, damage))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch's own message advises weights_only=False, which would run any code the file
        # names: never relay it. Say what the file is not, and what to do.
        text = str(exc)
        if isinstance(exc, pickle.UnpicklingError) and "GLOBAL" in text:
            reason = "it names code or types a checkpoint never holds; refused without running it"
        else:
            reason = f"truncated, corrupt or not a torch file: {type(exc).__name__}"
        raise UsageError(
            f"--checkpoint {str(path)!r}: expected a checkpoint written by `dataparallel "
            f"train`, got a file that cannot be read as one ({reason}); {fix}"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise UsageError(
            f"--checkpoint {str(path)!r}: expected format {CHECKPOINT_FORMAT!r}, got {found!r}; "
            f"{fix}"
        )
    damage = digest_damage(state)
    if damage is not None:
        raise UsageError(_damaged(path, damage))
    return state


def _damaged(path: str | os.PathLike[str], damage: str) -> str:
    return (
        f"--checkpoint {str(path)!r}: expected the checkpoint as it was written, found it "
        f"damaged ({damage}); nothing was resumed from it, and the file is kept as it is; "
        f"resume from a copy you trust, or start a new run without --resume (--overwrite "
        f"replaces the file)"
    )


def rng_state() -> dict[str, Any]:
    """This process's torch RNG state (and every CUDA device's, where CUDA is available)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore an RNG state taken by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def run_config(
    data: DemoData, batch_size: int, opts: TrainOptions, lr: float, world_size: int = 1
) -> dict[str, Any]:
    """What must match for a resumed run to continue the same run.

    ``world_size`` is the number of processes that cut the data (1 under dp, whatever its
    devices: one process takes each global batch whole). Under ddp each global batch is every
    rank's k-th batch, so the batch order depends on it: the layout is recorded and checked.
    """
    return {
        "data": data.spec,
        "batch_size": batch_size,
        "seed": opts.seed,
        "lr": lr,
        "momentum": opts.momentum,
        "batchnorm": opts.batchnorm,
        "layout": {"strategy": opts.strategy, "world_size": int(world_size)},
    }


# What a checkpoint written before an option existed was written with.
_BEFORE = {"batchnorm": "none"}


def _layout_words(layout: dict[str, Any]) -> str:
    n = layout["world_size"]
    return f"--strategy {layout['strategy']} on {n} process{'' if n == 1 else 'es'}"


def _check_layout(saved: Any, layout: dict[str, Any], path: str) -> None:
    """Refuse a resume whose number of processes differs from the checkpoint's.

    The order of the global batches depends on it (not on dp's devices, nor on dp against ddp
    on one process: those are the same run). A checkpoint written before the layout was
    recorded says nothing, and is resumed as before.
    """
    if not isinstance(saved, dict) or saved.get("world_size") == layout["world_size"]:
        return
    n = saved.get("world_size")
    ways = "--strategy dp (one process)" if n == 1 else f"--strategy ddp with {n} processes"
    raise UsageError(
        f"--resume: the checkpoint {path!r} was written by {_layout_words(saved)}, this run is "
        f"{_layout_words(layout)}: expected the checkpoint's {n} process(es), because the order "
        f"of the global batches depends on the number of processes and another number would "
        f"silently be a different run; resume with {ways} (--nproc-per-node times the nodes), "
        f"or start a new run without --resume"
    )


def check_resume(state: dict[str, Any], config: dict[str, Any], path: str) -> None:
    """Check that a checkpoint was written with this run's :func:`run_config`.

    Raises:
        UsageError: an option differs from the one the checkpoint was written with, or the
            number of processes (the layout) differs.
    """
    saved = state.get("config", {})
    for key, value in config.items():
        if key == "layout":
            continue
        if saved.get(key, _BEFORE.get(key)) != value:
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"--resume: the checkpoint {path!r} was written with {flag} "
                f"{saved.get(key)!r}, got {value!r}; resume with the same {flag}"
            )
    if "layout" in config:
        _check_layout(saved.get("layout"), config["layout"], path)


def resume(
    path: str,
    config: dict[str, Any],
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    out: TextIO | None,
    epochs: int | None = None,
) -> tuple[int, list[EpochStats]]:
    """Load a checkpoint into ``net`` and ``optimizer``; return the epochs done and history.

    With ``epochs`` (the run's total), the line printed to ``out`` says how far the run is,
    and, when the checkpoint already holds them all, how to train on.

    Raises:
        UsageError: the checkpoint is unreadable, was written with other options, or does not
            fit this model.
    """
    state = load_checkpoint(path)
    check_resume(state, config, path)
    try:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        epoch = int(state["epoch"])
        history = [EpochStats(**h) for h in state["history"]]
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--checkpoint {path!r}: does not fit this model and options ({reason}); "
            f"resume with the options it was written with, or start without --resume"
        ) from exc
    if out is not None:
        print(resume_message(path, epoch, epochs), file=out)
    return epoch, history


def resume_message(path: str, done: int, epochs: int | None) -> str:
    """What ``--resume`` says: the epochs the checkpoint holds against the run's total.

    A checkpoint that already holds every epoch asked for trains nothing; the message says so
    and how to go on (``--epochs M`` with ``M`` above the epochs it holds).
    """
    if epochs is None or done < epochs:
        total = "" if epochs is None else f" of {epochs}"
        return f"resumed from {path} after epoch {done}{total}"
    held = f"{done} of {epochs} epochs" if done == epochs else f"{done} epochs ({epochs} asked for)"
    return (
        f"resumed from {path}: the checkpoint already holds {held}, so no epoch is left to "
        f"train; to train on, pass --epochs M with M > {done}, e.g. --epochs {done + 10} "
        f"--checkpoint {path} --resume"
    )


def checkpoint_message(path: str, epoch: int) -> str:
    """Where ``--checkpoint`` wrote, said once per run (the file is rewritten every epoch)."""
    return (
        f"checkpoint written to {path} after epoch {epoch}; it is rewritten after every epoch "
        f"(continue with --checkpoint {path} --resume)"
    )


def checkpoint_state(
    epoch: int,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    history: list[EpochStats],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The state :func:`save_checkpoint` writes after ``epoch`` epochs."""
    return {
        "format": CHECKPOINT_FORMAT,
        "epoch": epoch,
        "model": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "history": [dataclasses.asdict(h) for h in history],
        "config": config,
    }


def end_epoch(
    stats: EpochStats,
    epochs: int,
    out: TextIO,
    path: str | None,
    state: Callable[[], dict[str, Any]],
    first: bool,
) -> None:
    """Close an epoch: write the checkpoint to ``path`` (when given) before the epoch's line, so
    the line means it is kept; print the line; on the run's ``first`` epoch, say where it wrote
    (once: the file is rewritten every epoch). ``state`` builds the checkpoint only if needed.

    Raises:
        TrainingError: the checkpoint could not be written (the disk is full, say); the
            previous one is kept as it was, and no temp file is left.
    """
    if path:
        try:
            save_checkpoint(path, state())
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise TrainingError(
                f"--checkpoint {path!r}: expected to write the checkpoint of epoch "
                f"{stats.epoch}, got {type(exc).__name__} ({reason}); the previous checkpoint "
                f"is kept as it was and no temp file is left; make room (or point --checkpoint "
                f"at another disk) and continue with --checkpoint {path} --resume"
            ) from None
    print_epoch(stats, epochs, out)
    if path and first:
        print(checkpoint_message(path, stats.epoch), file=out, flush=True)
