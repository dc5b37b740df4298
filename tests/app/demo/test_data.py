"""The demo's datasets: digits, CIFAR-10 python batches (with a restricted unpickler) and the
tutorial's random vectors."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# Imported at collection: scikit-learn sets KMP_* environment variables on first import, which
# the leak check in conftest.py would pin on whichever test imported it first.
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split  # noqa: F401

from dataparallel.app.demo.data import (
    CIFAR_CLASSES,
    DataError,
    RandomDataset,
    load_cifar10,
    load_dataset,
    write_cifar_like,
)

# ------------------------------------------------------------------------------------ digits


def test_digits_shapes_split_and_labels() -> None:
    data = load_dataset("digits")
    target = load_digits().target
    n_train, n_test = len(data.train_y), len(data.test_y)
    assert n_train + n_test == len(target) == 1797
    assert data.train_x.shape == (n_train, 1, 8, 8) and data.test_x.shape == (n_test, 1, 8, 8)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert data.input_shape == (1, 8, 8)
    assert data.classes == tuple(str(i) for i in range(10))
    # Every sample lands in exactly one part: class counts add up to the full set's.
    together = torch.bincount(torch.cat([data.train_y, data.test_y]), minlength=10)
    assert together.tolist() == np.bincount(target, minlength=10).tolist()
    # Stratified: each class's share of the test set is the overall share, within one sample.
    share = n_test / 1797
    for k, count in enumerate(np.bincount(target)):
        assert abs(int((data.test_y == k).sum()) - count * share) <= 1


def test_digits_split_is_fixed_and_normalised_like_the_tutorial() -> None:
    first, second = load_dataset("digits"), load_dataset("digits")
    assert torch.equal(first.train_x, second.train_x) and torch.equal(first.test_y, second.test_y)
    # Oracle: the tutorial's Normalize(0.5, 0.5) after scaling 0..16 to [0, 1].
    raw = load_digits().images.astype(np.float64)
    expected = (raw / 16.0 - 0.5) / 0.5
    ours = torch.cat([first.train_x, first.test_x]).double()
    assert float(ours.min()) == -1.0 and float(ours.max()) == 1.0
    assert float(ours.sum()) == pytest.approx(float(expected.sum()), rel=1e-9)
    assert float((ours**2).sum()) == pytest.approx(float((expected**2).sum()), rel=1e-9)
    # Each image is a real digits image: a row in the raw set.
    raw_rows = {tuple(r) for r in expected.reshape(-1, 64).round(6).tolist()}
    assert all(tuple(r) in raw_rows for r in first.test_x.double().reshape(-1, 64).tolist())


# ----------------------------------------------------------------------------------- CIFAR-10


def _read_plain(path: Path) -> dict[Any, Any]:
    # Our own test files: plain pickle is fine here, it is the oracle.
    with path.open("rb") as f:
        data: dict[Any, Any] = pickle.load(f, encoding="bytes")
        return data


def test_cifar_like_folder_loads_with_official_layout(tmp_path: Path) -> None:
    folder = write_cifar_like(tmp_path / "cifar", n_train=23, n_test=7)
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(
        [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]
    )
    # The files name the globals the official (numpy 1) files name.
    assert b"numpy.core.multiarray" in (folder / "test_batch").read_bytes()

    data = load_dataset(f"cifar10:{folder}")
    assert data.name == "cifar10" and data.classes == CIFAR_CLASSES
    assert data.train_x.shape == (23, 3, 32, 32) and data.test_x.shape == (7, 3, 32, 32)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    # Oracle: the raw pickles, reshaped and normalised as the tutorial does.
    batches = [_read_plain(folder / f"data_batch_{i}") for i in range(1, 6)]
    raw = np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32)
    labels = [label for b in batches for label in b[b"labels"]]
    expected = torch.from_numpy((raw.astype(np.float32) / 255.0 - 0.5) / 0.5)
    assert torch.allclose(data.train_x, expected)
    assert data.train_y.tolist() == labels
    assert data.test_y.tolist() == list(_read_plain(folder / "test_batch")[b"labels"])
    assert float(data.train_x.min()) >= -1.0 and float(data.train_x.max()) <= 1.0


def test_cifar_batches_with_str_keys_load(tmp_path: Path) -> None:
    # A Python 3 pickle (str keys, numpy 2 globals) of the same content.
    folder = write_cifar_like(tmp_path, n_train=10, n_test=4)
    for name in ("data_batch_1", "test_batch"):
        batch = _read_plain(folder / name)
        plain = {k.decode(): v for k, v in batch.items()}
        (folder / name).write_bytes(pickle.dumps(plain, protocol=4))
    data = load_cifar10(folder)
    assert len(data.test_y) == 4
    assert data.test_y.tolist() == list(_read_plain(folder / "test_batch")["labels"])


class _Evil:
    """Unpickling this runs ``func(*args)``, e.g. ``os.system("touch marker")``."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


@pytest.mark.parametrize("how", ["os.system", "io.open", "nested"])
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path, how: str) -> None:
    folder = write_cifar_like(tmp_path / "cifar", n_train=5, n_test=5)
    marker = tmp_path / "pwned"
    if how == "os.system":
        payload: Any = _Evil(os.system, f"touch {marker}")
        refused = "system"
    elif how == "io.open":
        payload = _Evil(open, str(marker), "w")
        refused = "io.open"
    else:  # hidden inside an otherwise normal batch
        batch = _read_plain(folder / "data_batch_1")
        batch[b"labels"] = [*batch[b"labels"][:-1], _Evil(os.system, f"touch {marker}")]
        payload = batch
        refused = "system"
    (folder / "data_batch_1").write_bytes(pickle.dumps(payload, protocol=3))

    with pytest.raises(DataError) as info:
        load_dataset(f"cifar10:{folder}")
    message = str(info.value)
    assert "data_batch_1" in message and refused in message and "refused" in message
    assert not marker.exists()


def test_missing_cifar_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="got no such folder; fix: download https://") as info:
        load_dataset(f"cifar10:{tmp_path / 'nowhere'}")
    assert "tar xzf cifar-10-python.tar.gz" in str(info.value)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(DataError, match="got a file; fix: download"):
        load_dataset(f"cifar10:{tmp_path / 'a-file'}")
    (tmp_path / "notes.txt").write_text("no CIFAR here")
    with pytest.raises(DataError, match=r"data_batch_1, test_batch are missing; fix: download"):
        load_dataset(f"cifar10:{tmp_path}")
    folder = write_cifar_like(tmp_path / "cifar", n_train=5, n_test=5)
    (folder / "test_batch").unlink()
    with pytest.raises(DataError, match="test_batch is missing"):
        load_dataset(f"cifar10:{folder}")


def test_broken_cifar_file_is_a_clear_error(tmp_path: Path) -> None:
    folder = write_cifar_like(tmp_path, n_train=5, n_test=5)
    (folder / "test_batch").write_bytes((folder / "test_batch").read_bytes()[:50])
    with pytest.raises(DataError, match="test_batch: not a readable CIFAR-10 batch"):
        load_cifar10(folder)
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": np.zeros((2, 5), np.uint8)}))
    with pytest.raises(DataError, match=r"expected 'data' to be an array of shape \(N, 3072\)"):
        load_cifar10(folder)


# ------------------------------------------------------------------------------ random, specs


def test_random_is_the_tutorials_dataset() -> None:
    data = load_dataset("random")
    assert data.train_x.shape == (100, 5) and data.test_x.shape == (100, 5)
    assert data.batch_size == 30 and data.input_shape == (5,)
    assert data.train_y.tolist() == (data.train_x.sum(dim=1) > 0).long().tolist()
    assert torch.equal(load_dataset("random").train_x, data.train_x)
    dataset = RandomDataset(5, 100)
    assert len(dataset) == 100 and dataset[3].shape == (5,)


@pytest.mark.parametrize("spec", ["mnist", "cifar10", "cifar10:", "digits:extra", ""])
def test_unknown_specs_are_clear_errors(spec: str) -> None:
    with pytest.raises(DataError, match="--data: expected"):
        load_dataset(spec)
