"""Bad input to the ``dataparallel`` command line: a table of cases, each ending with one line on
stderr that names the option and the fix, the exit code it should have, and no traceback.

Every case here is caught before the first epoch (exit 2), except a run whose loss stops being
finite, which stops with exit 3 and writes no checkpoint of the diverged model.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from dataparallel.app.cli import main
from dataparallel.app.demo.checkpoint import save_checkpoint
from dataparallel.app.demo.data import write_cifar_like

ERROR_PREFIX = "dataparallel: error: "

# Each case: (argv, exit code, what the one line must name, the fix it must give).
Case = tuple[list[str], int, str, str]


def _file(tmp: Path) -> Path:
    """A plain file, so that ``<file>/x`` is a path that no one can write, root included."""
    path = tmp / "a-file"
    path.write_text("x")
    return path


def _corrupt_checkpoint(tmp: Path) -> Path:
    path = tmp / "garbage.pt"
    path.write_bytes(os.urandom(256))
    return path


class _RunsCode:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def _malicious_checkpoint(tmp: Path) -> Path:
    path = tmp / "evil.pt"
    torch.save({"format": "dataparallel-demo/1", "model": _RunsCode()}, path)
    return path


def _earlier_checkpoint(tmp: Path) -> Path:
    path = tmp / "earlier.pt"
    save_checkpoint(path, {"epoch": 1})
    return path


def _as_written(path: Path) -> bool:
    """Whether ``path`` still holds what ``_earlier_checkpoint`` wrote (with its checksum)."""
    state = torch.load(path, weights_only=True)
    return bool(state.pop("checksum", "").startswith("sha256:")) and state == {"epoch": 1}


def _cifar(tmp: Path, *, n_test: int = 10, pixels: np.ndarray | None = None) -> str:
    folder = write_cifar_like(tmp / "cifar", n_train=20, n_test=n_test)
    if pixels is not None:
        batch = {b"batch_label": b"x", b"labels": [0] * len(pixels), b"data": pixels}
        (folder / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=3))
    return f"cifar10:{folder}"


FIX = "fix: "
CASES: dict[str, Callable[[Path], Case]] = {
    "lr inf": lambda t: (["train", "--data", "random", "--lr", "inf"], 2, "--lr", FIX),
    "lr nan": lambda t: (["train", "--data", "random", "--lr", "nan"], 2, "--lr", FIX),
    "lr 0": lambda t: (["train", "--data", "random", "--lr", "0"], 2, "--lr", FIX),
    "lr negative": lambda t: (["train", "--data", "random", "--lr", "-1"], 2, "--lr", FIX),
    "lr text": lambda t: (["train", "--data", "random", "--lr", "fast"], 2, "--lr", FIX),
    "seed 2**64": lambda t: (["train", "--data", "random", "--seed", str(2**64)], 2, "--seed", FIX),
    "seed negative": lambda t: (["train", "--data", "random", "--seed", "-1"], 2, "--seed", FIX),
    "seed text": lambda t: (["train", "--data", "random", "--seed", "x"], 2, "--seed", FIX),
    "devices meta": lambda t: (
        ["train", "--data", "random", "--devices", "meta"],
        2,
        "--devices",
        FIX,
    ),
    "devices cpu:1": lambda t: (
        ["train", "--data", "random", "--devices", "cpu:1"],
        2,
        "--devices",
        FIX,
    ),
    "devices cpu,meta": lambda t: (
        ["train", "--data", "random", "--devices", "cpu,meta"],
        2,
        "--devices[1]",
        FIX,
    ),
    "checkpoint under a file": lambda t: (
        ["train", "--data", "random", "--checkpoint", str(_file(t) / "c.pt")],
        2,
        "--checkpoint",
        FIX,
    ),
    "checkpoint is a folder": lambda t: (
        ["train", "--data", "random", "--checkpoint", str(t)],
        2,
        "--checkpoint",
        FIX,
    ),
    "json under a file": lambda t: (
        ["train", "--data", "random", "--json", str(_file(t) / "f.json")],
        2,
        "--json",
        FIX,
    ),
    "json is a folder": lambda t: (
        ["train", "--data", "random", "--json", str(t)],
        2,
        "--json",
        FIX,
    ),
    "plot under a file": lambda t: (
        ["train", "--data", "random", "--plot", str(_file(t) / "p.png")],
        2,
        "--plot",
        FIX,
    ),
    "bench out under a file": lambda t: (
        ["bench", "--out", str(_file(t) / "b.json")],
        2,
        "bench --out",
        FIX,
    ),
    "resume a corrupt file": lambda t: (
        ["train", "--data", "random", "--checkpoint", str(_corrupt_checkpoint(t)), "--resume"],
        2,
        "--checkpoint",
        FIX,
    ),
    "resume a pickle that runs code": lambda t: (
        ["train", "--data", "random", "--checkpoint", str(_malicious_checkpoint(t)), "--resume"],
        2,
        "--checkpoint",
        FIX,
    ),
    "cifar empty test set": lambda t: (
        ["train", "--data", _cifar(t, n_test=0)],
        2,
        "test_batch",
        FIX,
    ),
    "cifar pixels above 255": lambda t: (
        ["train", "--data", _cifar(t, pixels=np.full((4, 3072), 300.0))],
        2,
        "data_batch_1",
        FIX,
    ),
    "cifar pixels NaN": lambda t: (
        ["train", "--data", _cifar(t, pixels=np.full((4, 3072), np.nan))],
        2,
        "data_batch_1",
        FIX,
    ),
    "cifar pixels negative ints": lambda t: (
        ["train", "--data", _cifar(t, pixels=np.full((4, 3072), -5, dtype=np.int64))],
        2,
        "data_batch_1",
        FIX,
    ),
    "cifar folder missing": lambda t: (
        ["train", "--data", f"cifar10:{t / 'cifar-10-batches-py'}"],
        2,
        "--data cifar10:",
        "fix: download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    ),
    "plot suffix not an image format": lambda t: (
        ["train", "--data", "random", "--plot", str(t / "p.txt")],
        2,
        "--plot",
        "fix: --plot",
    ),
    "plot without a suffix": lambda t: (
        ["train", "--data", "random", "--plot", str(t / "curves")],
        2,
        "--plot",
        "fix: --plot",
    ),
    "checkpoint of an earlier run": lambda t: (
        ["train", "--data", "random", "--checkpoint", str(_earlier_checkpoint(t))],
        2,
        "--checkpoint",
        "fix: --resume to continue it, --overwrite to replace it",
    ),
    "overwrite with resume": lambda t: (
        ["train", "--data", "random", "--checkpoint", str(t / "c.pt"), "--resume", "--overwrite"],
        2,
        "--overwrite",
        FIX,
    ),
    "overwrite without a checkpoint": lambda t: (
        ["train", "--data", "random", "--overwrite"],
        2,
        "--overwrite",
        FIX,
    ),
    "loss not finite": lambda t: (
        ["train", "--lr", "1e10", "--epochs", "2", "--checkpoint", str(t / "c.pt")],
        3,
        "--lr",
        FIX,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_ends_with_one_line_naming_the_option_and_the_fix(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, code, option, fix = CASES[name](tmp_path)
    got = main(argv)
    out, err = capsys.readouterr()
    assert got == code, err
    assert err.startswith(ERROR_PREFIX) and err.count("\n") == 1, err
    assert option in err and fix in err, err
    assert "Traceback" not in out + err
    # torch's advice to turn the unpickling protection off is never relayed.
    assert "weights_only=False" not in err
    # Nothing was trained on bad input: no output file appeared, none was replaced.
    assert not (tmp_path / "c.pt").exists()
    assert not any((tmp_path / name).exists() for name in ("p.txt", "curves"))
    earlier = tmp_path / "earlier.pt"
    assert not earlier.exists() or _as_written(earlier)


def test_an_unknown_top_level_option_is_named_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{ERROR_PREFIX}unknown option --bogus: ") and err.count("\n") == 1
    assert err.count("--bogus") == 2  # the subject, and "got '--bogus'" (found, then fix)
    assert "expected a command (train, explain or bench) or --version" in err and "fix: " in err


def test_checkpoint_write_removes_stale_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "run.pt"
    stale = [tmp_path / ".run.pt.abc123.tmp", tmp_path / ".run.pt.zzz.tmp"]
    other = tmp_path / ".other.pt.abc.tmp"  # another checkpoint's temp: not ours to remove
    for path in [*stale, other]:
        path.write_bytes(b"half a checkpoint")
    save_checkpoint(target, {"epoch": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.abc.tmp", "run.pt"]
    assert _as_written(target)


def test_checkpoint_write_leaves_another_checkpoints_temp_file_alone(tmp_path: Path) -> None:
    # Another run is writing run.pt.1 in the same folder: its temp file exists, not yet
    # replaced. Writing run.pt must not remove it (the glob `.run.pt.*.tmp` matched it).
    fd, theirs = tempfile.mkstemp(prefix=".run.pt.1.", suffix=".tmp", dir=tmp_path)
    others = [Path(theirs), tmp_path / ".run.pt.bak.abc.tmp", tmp_path / ".run.pt.1.x.y.tmp"]
    for path in others[1:]:
        path.write_bytes(b"another checkpoint's write")
    with os.fdopen(fd, "wb") as f:
        torch.save({"epoch": 7}, f)
    ours_stale = tmp_path / ".run.pt.k3j_9q2z.tmp"  # a killed write of run.pt itself
    ours_stale.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path / "run.pt", {"epoch": 1})
    assert not ours_stale.exists()
    assert all(path.exists() for path in others), sorted(p.name for p in tmp_path.iterdir())
    os.replace(theirs, tmp_path / "run.pt.1")  # the other run's write completes
    assert torch.load(tmp_path / "run.pt.1", weights_only=True) == {"epoch": 7}
    assert _as_written(tmp_path / "run.pt")


def test_a_diverging_run_keeps_the_last_complete_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "c.pt"
    base = ["train", "--data", "random", "--checkpoint", str(ckpt), "--epochs", "1"]
    assert main(base) == 0
    before = ckpt.read_bytes()
    # A different --lr cannot resume this checkpoint, so the diverging run replaces it
    # (--overwrite): it must stop at the first non-finite loss without replacing the file.
    diverging = ["train", "--lr", "1e10", "--checkpoint", str(ckpt), "--epochs", "2"]
    assert main([*diverging, "--overwrite"]) == 3
    assert ckpt.read_bytes() == before
    err = capsys.readouterr().err
    assert "expected a finite loss" in err and "keeps the last complete checkpoint" in err


def test_a_checkpoint_that_names_code_is_told_apart_from_a_corrupt_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, reason in (
        (_malicious_checkpoint(tmp_path), "refused without running it"),
        (_corrupt_checkpoint(tmp_path), "corrupt"),
    ):
        assert main(["train", "--data", "random", "--checkpoint", str(path), "--resume"]) == 2
        err = capsys.readouterr().err
        assert reason in err and "weights_only" not in err, err
