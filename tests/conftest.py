"""Shared fixtures: every test is checked for leaked threads, environment variables and
process groups (Lightning Fabric's habit), so a test that leaves state behind fails."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

# scikit-learn (a dev dependency) sets KMP_* variables on first import: import it before any
# test runs, so the leak check below does not blame the first test that touches it.
import sklearn  # noqa: F401
import torch
from hypothesis import settings

# Property tests: derandomized under CI (CI=true), so `make test` gives one answer there and no
# saved failing example replays into later runs (no database); elsewhere hypothesis draws fresh
# examples and keeps what fails. HYPOTHESIS_PROFILE names either profile explicitly.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _CI else "dev"))

# Threads of the process-wide replica pool are created on first use and kept on purpose.
POOL_THREAD_PREFIX = "dataparallel-"
# torch's own threads that live as long as the process, started on first use: inductor's
# compile workers and their timer, and ``Dummy-N``, the name Python gives a thread it did not
# start (the autograd engine's per-GPU thread, once it runs a Python hook).
TORCH_THREAD_PREFIXES = ("InductorSubproc", "subproc_worker_timer", "Dummy-")


def _env() -> dict[str, str]:
    # pytest sets PYTEST_CURRENT_TEST while a test runs; torch sets its inductor (and, on a
    # GPU, Triton) cache folders on a lazy import. None of it is the test's doing.
    skip = ("PYTEST_", "TORCHINDUCTOR_", "TRITON_")
    return {k: v for k, v in os.environ.items() if not k.startswith(skip)}


def _foreign_threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.is_alive() and not t.name.startswith((POOL_THREAD_PREFIX, *TORCH_THREAD_PREFIXES))
    }


def pytest_configure(config: pytest.Config) -> None:
    """Give the suite Python's own Ctrl-C handling even when it was started with SIGINT
    ignored (a background job of a non-interactive shell inherits ``SIG_IGN``): the tests that
    send SIGINT to this process, or to the commands it starts (which inherit the default
    disposition from a handled signal), check what a user's Ctrl-C does."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaks threads, environment variables, a SIGINT handler or a process
    group."""
    before_threads = _foreign_threads()
    before_sigint = signal.getsignal(signal.SIGINT)
    before_env = _env()
    yield
    deadline = time.monotonic() + 2.0
    leaked = _foreign_threads() - before_threads
    while leaked and time.monotonic() < deadline:
        time.sleep(0.02)
        leaked = _foreign_threads() - before_threads
    problems = []
    if leaked:
        problems.append(f"threads left running: {sorted(t.name for t in leaked)}")
    env = _env()
    if env != before_env:
        changed = sorted(k for k in set(env) | set(before_env) if env.get(k) != before_env.get(k))
        for key in changed:
            if key in before_env:
                os.environ[key] = before_env[key]
            else:
                os.environ.pop(key, None)
        problems.append(f"environment variables changed: {changed}")
    if signal.getsignal(signal.SIGINT) is not before_sigint:
        signal.signal(signal.SIGINT, before_sigint)
        problems.append("the SIGINT handler was replaced and not restored")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        problems.append("a process group was left initialised")
    if problems:
        pytest.fail("; ".join(problems))


# `make test`'s schedule (pytest-xdist): each test file is one unit of work, its tests together
# and in order on one worker, except the files of the `slow` tests (real processes, end-to-end
# commands, limits in seconds), which form a few chains: each chain is one unit, its files one
# after the other on a worker of their own, beside the other chains and the other files. The
# chains are cut where the tests share nothing but the machine: those that wait on limits of a
# few seconds (timeouts, signals, stalls) are one chain, so no two of them ever run at once; the
# other multi-process tests are another; the README's commands, the bare install and the
# benchmarks a third. The chains start first: they are the longest units. (A fourth chain,
# the bare install and the benchmarks apart from the README's commands, was tried at stop 77:
# the run took 667 s against 601 s before, the suite being bound by the two cores rather than
# by its longest chain; it only added load beside the chain of limits in seconds.)
SLOW_CHAINS = {
    "slow: limits in seconds": (
        "tests/distributed/test_stalls.py",
        "tests/distributed/test_rendezvous.py",
        "tests/distributed/test_lifecycle.py",
        "tests/app/test_cli_signals.py",
    ),
    "slow: processes": (
        "tests/distributed/test_multiprocess.py",
        "tests/distributed/test_launch.py",
        "tests/distributed/test_uneven_steps.py",
        "tests/distributed/test_syncbn_ddp.py",
        "tests/distributed/test_gather_counts.py",
        "tests/app/test_checkpoint_damage.py",
        "tests/wrapper/test_warm_fork.py",
        "tests/replicate/test_writes_at_once.py",
    ),
    "slow: commands": (
        "tests/test_readme.py",
        "tests/test_bare_install.py",
        "tests/test_readme_figures.py",
        "tests/test_benchmarks.py",
    ),
}
_CHAIN_OF = {path: chain for chain, paths in SLOW_CHAINS.items() for path in paths}


def work_unit(nodeid: str) -> str:
    """The unit of work of the test ``nodeid``: its chain, else its file."""
    path = nodeid.split("::", 1)[0]
    return _CHAIN_OF.get(path, path)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduling by scope, with :func:`work_unit` as the scope, and the units handed
    out in the order of the collection, which :func:`pytest_collection_modifyitems` sets."""
    from xdist.scheduler import LoadScopeScheduling

    class _Units(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return _Units(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests by unit of work, the chains first, then the files with the most tests
    (the order xdist hands them out in); refuse a slow test outside every chain; skip
    CUDA-marked tests on machines without CUDA, saying why."""
    outside = sorted(
        {i.nodeid.split("::", 1)[0] for i in items if i.get_closest_marker("slow")} - set(_CHAIN_OF)
    )
    if outside:
        raise pytest.UsageError(
            f"tests/conftest.py SLOW_CHAINS: {outside} hold tests marked slow but are in no "
            f"chain; expected every file with a slow test in one chain; add each to the chain "
            f"whose tests it is like (limits in seconds, processes or commands)"
        )
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(work_unit(item.nodeid), []).append(item)
    chains = list(SLOW_CHAINS)
    order = sorted(
        units, key=lambda u: (chains.index(u), 0) if u in chains else (len(chains), -len(units[u]))
    )
    items[:] = [item for unit in order for item in units[unit]]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
