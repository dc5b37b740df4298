"""A damaged checkpoint is refused, and a checkpoint the disk cannot hold is one line (issue
63, items 2 and 8): real ``dataparallel train`` processes, real files.

``torch.load`` does not check the zip's CRC-32s, so a block of zeros inside a weight record
was resumed (weights off by up to 0.72), trained on and written over. Now each record is
checked against its CRC-32 and the contents against the SHA-256 written with them before a
resume, and by ``dp.load_unwrapped``: refused in one line naming the file, which is kept.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import dataparallel as dp
from dataparallel.app.demo.checkpoint import load_checkpoint, save_checkpoint
from dataparallel.app.demo.options import UsageError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TRAIN = [sys.executable, "-m", "dataparallel", "train", "--data", "random", "--no-progress"]


def _train(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [*TRAIN, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=150
    )


def _damage(path: Path, flip: bool) -> None:
    """Zero 4 KiB (or flip 64 bytes) in the middle of the largest record, size unchanged."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len
    size = 64 if flip else min(4096, info.file_size // 2)
    at = start + (info.file_size - size) // 2
    data[at : at + size] = bytes(b ^ 0xFF for b in data[at : at + size]) if flip else bytes(size)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def epoch_two(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """An epoch-2 checkpoint of ``dataparallel train``, written once for the module."""
    where = tmp_path_factory.mktemp("written")
    first = _train(where, "--epochs", "2", "--checkpoint", str(where / "ck.pt"))
    assert first.returncode == 0, first.stderr
    return (where / "ck.pt").read_bytes()


@pytest.mark.parametrize("flip", [False, True], ids=["zeroed 4 KiB", "64 bytes flipped"])
def test_a_damaged_checkpoint_is_refused_and_kept(
    tmp_path: Path, epoch_two: bytes, flip: bool
) -> None:
    ckpt = tmp_path / "ck.pt"
    ckpt.write_bytes(epoch_two)
    _damage(ckpt, flip)
    damaged = ckpt.read_bytes()
    done = _train(tmp_path, "--epochs", "4", "--checkpoint", str(ckpt), "--resume")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "resumed" not in done.stdout
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"dataparallel: error: --checkpoint {str(ckpt)!r}: "), done.stderr
    assert "damaged (its record " in done.stderr and "CRC-32" in done.stderr
    assert "the file is kept as it is" in done.stderr
    assert ckpt.read_bytes() == damaged  # not written over
    with pytest.raises(ValueError, match=r"found it damaged \(its record "):
        dp.load_unwrapped(ckpt, torch.nn.Linear(1, 1))  # refused before any key is read


def test_contents_that_no_longer_match_their_checksum_are_refused(tmp_path: Path) -> None:
    """A record rewritten whole (its CRC-32 with it) still fails the SHA-256 of the
    contents, which a ``dataparallel train`` checkpoint carries."""
    net = torch.nn.Linear(3, 2)
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"format": "dataparallel-demo/1", "model": net.state_dict()})
    state = torch.load(path, weights_only=True)
    assert state["checksum"].startswith("sha256:")
    assert load_checkpoint(path)["model"].keys() == net.state_dict().keys()
    dp.load_unwrapped(path, torch.nn.Linear(3, 2))
    state["model"]["weight"][0, 0] += 1.0
    torch.save(state, path)  # fresh CRC-32s, the old checksum
    with pytest.raises(UsageError, match="SHA-256 checksum"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="SHA-256 checksum"):
        dp.load_unwrapped(path, torch.nn.Linear(3, 2))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``mount(size)``: a tmpfs of ``size`` bytes (root only), unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / "small"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounts a small tmpfs: Linux, as root")
    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_a_full_disk_while_checkpointing_is_one_line(
    tmp_path: Path, epoch_two: bytes, small_disk: Callable[[int], Path]
) -> None:
    """Issue 63, item 8: the disk filling during a checkpoint's write ended with rank 0's
    41-line traceback ending ``OSError: [Errno 28] No space left on device``. The disk here
    holds one checkpoint and a half: the first epoch's fits, the second's temp file does not.
    """
    disk = small_disk(len(epoch_two) * 3 // 2)  # every epoch's checkpoint has one size
    ckpt = disk / "ck.pt"
    done = _train(tmp_path, "--epochs", "3", "--checkpoint", str(ckpt))
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"dataparallel: error: --checkpoint {str(ckpt)!r}: expected to write the checkpoint of "
        f"epoch 2, got OSError (No space left on device); the previous checkpoint is kept"
    ), done.stderr
    assert [p.name for p in disk.iterdir()] == ["ck.pt"]  # no temp file left
    assert load_checkpoint(ckpt)["epoch"] == 1  # intact, checksums and all
