"""Shared fixtures: every test is checked for leaked threads, environment variables and
process groups (Lightning Fabric's habit), so a test that leaves state behind fails."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

# Threads of the process-wide replica pool are created on first use and kept on purpose.
POOL_THREAD_PREFIX = "dataparallel-"


def _foreign_threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.is_alive() and not t.name.startswith(POOL_THREAD_PREFIX)
    }


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaks threads, environment variables or a process group."""
    before_threads = _foreign_threads()
    before_env = dict(os.environ)
    yield
    deadline = time.monotonic() + 2.0
    leaked = _foreign_threads() - before_threads
    while leaked and time.monotonic() < deadline:
        time.sleep(0.02)
        leaked = _foreign_threads() - before_threads
    problems = []
    if leaked:
        problems.append(f"threads left running: {sorted(t.name for t in leaked)}")
    env = dict(os.environ)
    if env != before_env:
        changed = sorted(k for k in set(env) | set(before_env) if env.get(k) != before_env.get(k))
        os.environ.clear()
        os.environ.update(before_env)
        problems.append(f"environment variables changed: {changed}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        problems.append("a process group was left initialised")
    if problems:
        pytest.fail("; ".join(problems))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip CUDA-marked tests on machines without CUDA, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
