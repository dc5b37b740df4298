"""Helpers for the multi-process tests: spawning gloo workers and comparing nested results.

Environment variables (torchrun's) are set only inside the child processes, so the test process
itself never changes its environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from dataparallel.app.launch import free_port
from dataparallel.distributed import DistInfo, destroy_distributed, init_distributed

__all__ = ["REPO", "assert_same", "child_env", "distributed", "run_workers"]

REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a launcher subprocess: ours, one OpenMP thread, the repo importable."""
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # these are the gloo-on-CPU tests, on a GPU machine too
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _entry(
    local_rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple
) -> None:
    # Inside the child only: torchrun's variables, as torchrun would set them.
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",  # gloo on the CPU, on a GPU machine too (before CUDA starts)
    )
    torch.set_num_threads(1)
    fn(*args)


def run_workers(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``world_size`` spawned processes with torchrun's variables set.

    An exception in any worker fails the caller (``mp.spawn`` re-raises it with its traceback
    and terminates the other workers). ``fn`` must be a module-level function; the children
    find its module through the parent's ``sys.path``, which ``spawn`` hands them.
    """
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


@contextmanager
def distributed() -> Iterator[DistInfo]:
    """``init_distributed()`` for the block; torn down after it (no barrier after an error)."""
    info = init_distributed()
    try:
        yield info
    except BaseException:
        destroy_distributed(barrier=False)
        raise
    destroy_distributed()


def assert_same(got: Any, expected: Any, path: str = "output") -> None:
    """Exact equality of nested results: types, keys, lengths, tensor dtypes and values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: expected a tensor, got {type(got)}"
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{path}: shape {got.shape} != {expected.shape}"
        assert torch.equal(got.cpu(), expected.cpu()), f"{path}: values differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: expected an ndarray, got {type(got)}"
        np.testing.assert_array_equal(got, expected)
    elif isinstance(expected, Mapping):
        assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for key in expected:
            assert_same(got[key], expected[key], f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
        for field in dataclasses.fields(expected):
            assert_same(
                getattr(got, field.name), getattr(expected, field.name), f"{path}.{field.name}"
            )
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
        assert len(got) == len(expected), f"{path}: length {len(got)} != {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{path}[{i}]")
    else:
        assert type(got) is type(expected) and got == expected, f"{path}: {got!r} != {expected!r}"
