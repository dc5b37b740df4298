"""torchrun's restarts continue the run (issue 51, item 10): with ``--max-restarts 1`` and a
worker lost after the first checkpoint, the restarted workers continue from the job's own
``--checkpoint`` (before: they refused it as another run's, "expected a path with no file
yet", and the job failed), and the run ends as the same run uninterrupted, epoch for epoch.
Real processes: torchrun's agent, two gloo workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_restart_worker.py")


def _torchrun(
    tmp_path: Path, name: str, script: list[str]
) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    ckpt, figures = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
    args = [
        "train", "--data", "random", "--batch-size", "16", "--strategy", "ddp",
        "--devices", "cpu", "--epochs", "3", "--checkpoint", str(ckpt), "--json", str(figures),
        "--no-progress",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.2", *script, *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return done, ckpt, figures


@pytest.mark.timeout(600)
def test_a_restarted_job_continues_from_its_checkpoint(tmp_path: Path) -> None:
    done, ckpt, figures = _torchrun(tmp_path, "restarted", [str(WORKER)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "after epoch 1 of 3" in done.stdout, done.stdout
    whole, _, whole_figures = _torchrun(tmp_path, "whole", ["-m", "dataparallel"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    got = json.loads(figures.read_text())["history"]
    want = json.loads(whole_figures.read_text())["history"]
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["test_accuracy"] == b["test_accuracy"]
    assert ckpt.is_file()
