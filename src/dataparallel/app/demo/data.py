"""Datasets for the demo: scikit-learn's digits, CIFAR-10 python batches and the tutorial's
random vectors.

Everything is loaded into memory as tensors up front: the demo sets are small, and indexing a
tensor is faster and easier to make deterministic than a DataLoader with workers. A dataset
spec is one of:

- ``"digits"`` (the default): scikit-learn's bundled 8x8 digits, 1,797 images, 10 classes,
  with a fixed stratified train/test split, scaled to [-1, 1] like the tutorial's CIFAR images;
- ``"cifar10:DIR"``: the official CIFAR-10 python batches in ``DIR``, read with a restricted
  unpickler that only rebuilds numpy arrays (the files are pickles, and a pickle can run any
  code it names);
- ``"random"``: the tutorial's ``RandomDataset`` (100 vectors of size 5, batch 30), with a
  label (the sign of the vector's sum) so that it can be trained like the others.
"""

from __future__ import annotations

import importlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = [
    "CIFAR_CLASSES",
    "CIFAR_HOWTO",
    "CIFAR_URL",
    "HYPER",
    "DataError",
    "DemoData",
    "Hyper",
    "RandomDataset",
    "RestrictedUnpickler",
    "load_cifar10",
    "load_dataset",
    "load_digits_data",
    "load_random",
    "write_cifar_like",
]

CIFAR_CLASSES = (
    "plane",
    "car",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))


class Hyper(NamedTuple):
    """A dataset's defaults for ``dataparallel train``: what ``--help`` shows and runs use."""

    batch_size: int
    epochs: int
    lr: float


HYPER: dict[str, Hyper] = {
    # digits, measured on a 2-core CPU: test accuracy 0.975-0.986 over seeds 0-4, a few seconds
    "digits": Hyper(batch_size=32, epochs=20, lr=0.02),
    "random": Hyper(batch_size=30, epochs=1, lr=0.1),
    "cifar10": Hyper(batch_size=32, epochs=2, lr=0.01),
}
"""Per-dataset defaults of ``--batch-size``, ``--epochs`` and ``--lr``, by dataset name."""
_CIFAR_TEST = "test_batch"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
_CIFAR_META = "batches.meta"


class DataError(ValueError):
    """A dataset spec or a dataset's files are not usable; the message says how to fix it."""


@dataclass(frozen=True)
class DemoData:
    """One demo dataset, in memory, with the defaults that train it well.

    Attributes:
        name: ``"digits"``, ``"cifar10"`` or ``"random"``.
        spec: the spec it was loaded from (``"cifar10:/data/cifar"``), for checkpoints.
        train_x, train_y: training inputs (float32) and labels (int64).
        test_x, test_y: test inputs and labels.
        classes: class names, index = label.
        input_shape: the shape of one sample, e.g. ``(1, 8, 8)``.
        batch_size, epochs, lr: defaults for ``dataparallel train``.
    """

    name: str
    spec: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: tuple[str, ...]
    input_shape: tuple[int, ...]
    batch_size: int
    epochs: int
    lr: float

    @property
    def train(self) -> TensorDataset:
        """The training set as ``(input, label)`` pairs."""
        return TensorDataset(self.train_x, self.train_y)

    @property
    def test(self) -> TensorDataset:
        """The test set as ``(input, label)`` pairs."""
        return TensorDataset(self.test_x, self.test_y)


# --------------------------------------------------------------------------------------------
# digits


def _to_unit_range(x: np.ndarray, top: float) -> torch.Tensor:
    # The tutorial's Normalize((0.5,), (0.5,)) after ToTensor: [0, top] -> [-1, 1].
    return torch.from_numpy((x.astype(np.float32) / top - 0.5) / 0.5)


def load_digits_data(*, test_fraction: float = 0.2, seed: int = 0) -> DemoData:
    """scikit-learn's digits as ``(N, 1, 8, 8)`` float32 images in [-1, 1], stratified split.

    The split is fixed by ``seed`` (not by the training seed), so that every run is scored on
    the same test images.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise DataError(
            "--data digits: expected scikit-learn (it holds the digits), got none installed; "
            "fix: pip install 'dataparallel[demo]', or use --data random"
        ) from exc
    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32)  # (1797, 8, 8), values 0..16
    labels = np.asarray(bunch.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, stratify=labels, random_state=seed
    )
    return DemoData(
        name="digits",
        spec="digits",
        train_x=_to_unit_range(x_train, 16.0).unsqueeze(1).contiguous(),
        train_y=torch.from_numpy(y_train),
        test_x=_to_unit_range(x_test, 16.0).unsqueeze(1).contiguous(),
        test_y=torch.from_numpy(y_test),
        classes=tuple(str(i) for i in range(10)),
        input_shape=(1, 8, 8),
        **HYPER["digits"]._asdict(),
    )


# --------------------------------------------------------------------------------------------
# CIFAR-10


def _reconstruct() -> Any:
    # numpy 2 moved numpy.core to numpy._core; importing numpy.core there warns, so prefer the
    # new home and fall back for numpy 1.x.
    # (By name: which of the two a type checker can see depends on the numpy it reads.)
    try:
        home = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy < 1.26 has no numpy._core
        home = importlib.import_module("numpy.core.multiarray")
    return home._reconstruct


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds numpy arrays and nothing else.

    The CIFAR-10 python batches are pickles of dicts of lists, bytes and uint8 arrays. The
    only globals they name are numpy's array reconstruction (``numpy.core.multiarray.
    _reconstruct``, ``numpy._core.multiarray._reconstruct`` under numpy 2), ``numpy.ndarray``
    and ``numpy.dtype``. Any other global is refused before it is looked up, so a file
    crafted to call ``os.system`` (or anything else) runs nothing.
    """

    _ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }
    )

    def __init__(self, file: IO[bytes], *, source: str) -> None:
        super().__init__(file, encoding="bytes")
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        """Return one of the allowed numpy globals; refuse every other one."""
        if (module, name) not in self._ALLOWED:
            raise DataError(
                f"{self._source}: refused to load global {module}.{name!s} from this pickle; "
                f"a CIFAR-10 batch only needs numpy's array reconstruction "
                f"(numpy.core.multiarray._reconstruct, numpy.ndarray, numpy.dtype); "
                f"this file is not an official CIFAR-10 python batch, get a fresh copy from "
                f"https://www.cs.toronto.edu/~kriz/cifar.html"
            )
        if name == "_reconstruct":
            return _reconstruct()
        return np.ndarray if name == "ndarray" else np.dtype

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids: CIFAR-10 batches have none."""
        raise DataError(f"{self._source}: refused a persistent id {pid!r} in this pickle")


def _load_pickle(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            obj = RestrictedUnpickler(f, source=str(path)).load()
    except DataError:
        raise
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    except Exception as exc:  # a truncated or foreign file: say which and why, no traceback
        raise DataError(
            f"{path}: not a readable CIFAR-10 batch ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a dict, got {type(obj).__name__}")
    # Python 2 pickles read with encoding="bytes" have bytes keys; Python 3 ones have str keys.
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _batch_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _load_pickle(path)
    data = batch.get("data")
    labels = batch.get("labels", batch.get("fine_labels"))
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        found = data.shape if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: expected 'data' to be an array of shape (N, 3072), got {found!r}")
    y = np.asarray(labels, dtype=np.int64)
    if y.shape != (data.shape[0],):
        raise DataError(
            f"{path}: expected {data.shape[0]} labels, got {y.shape[0] if y.ndim else 0}"
        )
    low, high = (int(np.min(y)), int(np.max(y))) if y.size else (0, 0)
    if low < 0 or high >= 10:
        raise DataError(f"{path}: expected labels in 0..9, got {low}..{high}")
    _check_pixels(path, data)
    return data.reshape(-1, 3, 32, 32), y


def _check_pixels(path: Path, data: np.ndarray) -> None:
    # The official batches hold uint8 pixels; any other array must still be 0..255, or the
    # scaling to [-1, 1] trains on values the model never sees in real CIFAR-10.
    fix = "fix: use the official CIFAR-10 python batches (uint8 pixels 0..255)"
    if data.dtype == np.uint8 or data.size == 0:
        return
    if data.dtype.kind not in "biuf":
        raise DataError(
            f"{path}: expected pixel values 0..255, got an array of {data.dtype}; {fix}"
        )
    low, high = data.min(), data.max()
    if not (low >= 0 and high <= 255):  # NaN fails both comparisons
        raise DataError(
            f"{path}: expected pixel values 0..255, got values from {low} to {high}; {fix}"
        )


def _class_names(folder: Path) -> tuple[str, ...]:
    meta_path = folder / _CIFAR_META
    if not meta_path.exists():
        return CIFAR_CLASSES
    names = _load_pickle(meta_path).get("label_names")
    if not isinstance(names, list) or len(names) != 10:
        return CIFAR_CLASSES
    return tuple(n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names)


CIFAR_HOWTO = (
    f"download {CIFAR_URL} (about 170 MB), unpack it with `tar xzf cifar-10-python.tar.gz` "
    f"and pass --data cifar10:cifar-10-batches-py (the folder it makes)"
)
"""How to get the real CIFAR-10, as the errors about a missing folder or batch say it."""


def load_cifar10(folder: str | os.PathLike[str]) -> DemoData:
    """The official CIFAR-10 python batches in ``folder``, as (N, 3, 32, 32) images in [-1, 1].

    ``folder`` is the ``cifar-10-batches-py`` directory of the official archive. Training uses
    every ``data_batch_*`` present (at least one), testing uses ``test_batch``.

    Raises:
        DataError: the folder does not exist, holds no CIFAR-10 batches, or a file is not a
            CIFAR-10 batch (including one that names a global other than numpy's arrays).
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        got = "a file" if root.exists() else "no such folder"
        raise DataError(
            f"--data cifar10:{folder}: expected a folder holding the CIFAR-10 python batches "
            f"(data_batch_1..5, test_batch), got {got}; fix: {CIFAR_HOWTO}, or use --data "
            f"digits (bundled)"
        )
    train_files = [root / n for n in _CIFAR_TRAIN if (root / n).is_file()]
    test_file = root / _CIFAR_TEST
    if not train_files or not test_file.is_file():
        missing = [n for n in (*_CIFAR_TRAIN[:1], _CIFAR_TEST) if not (root / n).is_file()]
        raise DataError(
            f"--data cifar10:{folder}: expected the CIFAR-10 python batches (data_batch_1..5 "
            f"and test_batch), but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"missing; fix: {CIFAR_HOWTO}"
        )
    parts = [_batch_arrays(p) for p in train_files]
    test_images, test_labels = _batch_arrays(test_file)
    train_images = np.concatenate([p[0] for p in parts])
    train_labels = np.concatenate([p[1] for p in parts])
    # An empty set would train on nothing or score "accuracy 0.0000 (0/0)" and exit 0.
    for name, labels in (("test_batch", test_labels), ("data_batch_*", train_labels)):
        if len(labels) == 0:
            raise DataError(
                f"--data cifar10:{folder}: expected at least one image in {name}, got none; "
                f"fix: use the official CIFAR-10 python batches, whose {name} hold 10,000 "
                f"images each"
            )
    return DemoData(
        name="cifar10",
        spec=f"cifar10:{folder}",
        train_x=_to_unit_range(train_images, 255.0),
        train_y=torch.from_numpy(train_labels),
        test_x=_to_unit_range(test_images, 255.0),
        test_y=torch.from_numpy(test_labels),
        classes=_class_names(root),
        input_shape=(3, 32, 32),
        **HYPER["cifar10"]._asdict(),
    )


def write_cifar_like(
    folder: str | os.PathLike[str], n_train: int, n_test: int, *, seed: int = 0
) -> Path:
    """Write a tiny folder in the official CIFAR-10 python format, for tests and docs.

    Each class gets a different mean colour, so that a model can learn it. The pickles name the
    same globals as the official files (``numpy.core.multiarray._reconstruct``), use bytes keys
    like a Python 2 pickle read with ``encoding="bytes"``, and ``n_train`` is spread over
    ``data_batch_1..5``.

    Returns:
        The folder, created if needed.
    """
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def make(n: int) -> tuple[np.ndarray, list[int]]:
        labels = [i % 10 for i in range(n)]
        rng.shuffle(labels)
        base = np.array([(37 * k) % 256 for k in range(30)], dtype=np.int64).reshape(10, 3)
        noise = rng.integers(-40, 41, size=(n, 3, 32 * 32))
        pixels = np.clip(base[np.array(labels, dtype=np.int64)][:, :, None] + noise, 0, 255)
        return pixels.reshape(n, 3072).astype(np.uint8), labels

    def dump(obj: dict[bytes, Any], name: str) -> None:
        # Protocol 3 writes globals as text lines; rename numpy 2's module to the one the
        # official (numpy 1, Python 2) files name, so the loader sees what it will see in use.
        raw = pickle.dumps(obj, protocol=3)
        raw = raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
        (root / name).write_bytes(raw)

    sizes = [n_train // 5 + (1 if i < n_train % 5 else 0) for i in range(5)]
    for i, size in enumerate(sizes, start=1):
        data, labels = make(size)
        dump(
            {b"batch_label": b"training batch %d of 5" % i, b"labels": labels, b"data": data},
            f"data_batch_{i}",
        )
    data, labels = make(n_test)
    dump({b"batch_label": b"testing batch 1 of 1", b"labels": labels, b"data": data}, "test_batch")
    dump(
        {
            b"label_names": [n.encode() for n in CIFAR_CLASSES],
            b"num_cases_per_batch": max(sizes),
            b"num_vis": 3072,
        },
        _CIFAR_META,
    )
    return root


# --------------------------------------------------------------------------------------------
# random


class RandomDataset(Dataset[torch.Tensor]):
    """The tutorial's dummy dataset: ``length`` random vectors of size ``size``.

    As in the tutorial, an item is the vector alone; ``labels`` (1 where the vector's sum is
    positive) let the training demo use it like the other sets.
    """

    def __init__(self, size: int, length: int, *, generator: torch.Generator | None = None):
        self.len = length
        self.data = torch.randn(length, size, generator=generator)
        self.labels = (self.data.sum(dim=1) > 0).long()

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


def load_random(*, size: int = 5, length: int = 100, seed: int = 0) -> DemoData:
    """The tutorial's random vectors: 100 of size 5 to train on (batch 30), 100 more to test."""
    gen = torch.Generator().manual_seed(seed)
    train, test = (
        RandomDataset(size, length, generator=gen),
        RandomDataset(size, length, generator=gen),
    )
    return DemoData(
        name="random",
        spec="random",
        train_x=train.data,
        train_y=train.labels,
        test_x=test.data,
        test_y=test.labels,
        classes=("negative", "positive"),
        input_shape=(size,),
        **HYPER["random"]._asdict(),
    )


# --------------------------------------------------------------------------------------------


def load_dataset(spec: str) -> DemoData:
    """Load a demo dataset from its spec: ``"digits"``, ``"random"`` or ``"cifar10:DIR"``.

    Raises:
        DataError: the spec is unknown, or its files are missing or unusable.
    """
    name, sep, arg = spec.partition(":")
    if name == "digits" and not sep:
        return load_digits_data()
    if name == "random" and not sep:
        return load_random()
    if name == "cifar10":
        if not arg:
            raise DataError(
                f"--data: expected cifar10:DIR with the folder of the CIFAR-10 python batches, "
                f"got {spec!r}"
            )
        return load_cifar10(arg)
    raise DataError(f"--data: expected digits, random or cifar10:DIR, got {spec!r}")
