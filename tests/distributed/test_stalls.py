"""A collective past the group's limit is our ``TimeoutError``, naming the rank that stopped.

Issue 51, items 3 and 4: gloo gave up on time, but with its own "Timed out waiting 5000ms for
recv", and the launcher's summary then blamed the rank that gave up ("first: rank 0 ... exited
with code 1") after 28 lines of its traceback. Real gloo processes: one rank stops (SIGSTOP, as
a debugger or a swapped-out process would) or is only late (asleep in Python).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dataparallel.app.launch import free_port

from ._helpers import REPO, child_env
from .test_launch import _process_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Two ranks in a ddp_session with a 3 s limit. One rank (argv[3], rank 1 unless told) stops
# itself (argv "stop") or sleeps 10 s (argv "late"); the other runs the collective (argv
# "gather_all", "all_reduce" or "ddp").
_RANK = """
import os, signal, sys, time
import torch, torch.distributed as dist
from dataparallel.distributed import ddp_session, gather_all
how, what, slow = sys.argv[1], sys.argv[2], int(sys.argv[3])
began = float("nan")
try:
    with ddp_session(torch.nn.Linear(2, 1), backend="gloo", timeout=3) as (ddp, info):
        began = time.monotonic()  # (the rendezvous waits for the other rank's torch import)
        print("pid", os.getpid(), flush=True)
        if info.rank == slow:
            time.sleep(1.0)  # a few heartbeats first
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(10)
        if what == "gather_all":
            gather_all(torch.ones(1))
        elif what == "all_reduce":
            dist.all_reduce(torch.ones(1))
        else:
            ddp(torch.ones(3, 2)).sum().backward()
except Exception as exc:
    kind = "TimeoutError" if isinstance(exc, TimeoutError) else type(exc).__name__
    print(kind, "|", str(exc), flush=True)
    print("took", time.monotonic() - began, flush=True)
"""


def _env(rank: int, port: int) -> dict[str, str]:
    return child_env(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _run(how: str, what: str, slow: int = 1) -> str:
    """The line the rank that is not ``slow`` ended with; every process is gone when it
    returns. A port another test took between ``free_port`` and rank 0's listen (CI's five
    workers start jobs at once; met once, newest torch) is no stall: the run is made again on
    another port, at most twice."""
    for _ in range(2):
        line = _run_once(how, what, slow)
        if "cannot listen on" not in line:
            return line
    return _run_once(how, what, slow)


def _run_once(how: str, what: str, slow: int) -> str:
    """``_run``'s one try. The time to the line is the rank's own, from its session's start:
    starting Python and importing torch (which the rendezvous waits for), or ending the
    process, on a loaded machine (CI's five workers: 30.7 s in all once) is not what is
    asked."""
    port = free_port()
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, how, what, str(slow)],
            env=_env(rank, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # torch's C++ logs
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        lines = runs[1 - slow].communicate(timeout=60)[0].strip().splitlines() or [""]
        took = float(lines[-1].split()[-1]) if lines[-1].startswith("took ") else float("inf")
        line = lines[-2] if len(lines) > 1 else lines[-1]
        if "cannot listen on" in line:
            return line  # (tried again by ``_run``)
        # 1 s of heartbeats, the 3 s limit, the look (at most 4 s to a stopped store) and the
        # heartbeat's stop (at most 5 s): about 11 s on a quiet machine
        assert took < 30, lines
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    return line


@pytest.mark.parametrize("what", ["gather_all", "all_reduce", "ddp"])
def test_a_rank_that_stopped_is_named(what: str) -> None:
    line = _run("stop", what)
    assert re.fullmatch(
        r"TimeoutError \| rank 0 of 2: a collective waited 3 s, the group's limit, and gave up: "
        r"rank 1 \(pid \d+ on host [^)]+\) has stopped answering \(no heartbeat in the job's "
        r"store at MASTER_ADDR:MASTER_PORT=127\.0\.0\.1:\d+ for 2 s\); expected every rank to "
        r"reach the same collective within the limit; see why that process stopped .*"
        r"DATAPARALLEL_DIST_TIMEOUT=seconds",
        line,
    ), line


def test_a_stopped_store_host_is_named_within_the_limit() -> None:
    """Issue 63, item 1: rank 0 (the store's host) stopped; rank 1's look at the heartbeats
    waited forever in the connect to the stopped store (torch's client timeout does not
    bound it). Every wait of the look is bounded: the line comes within seconds."""
    line = _run("stop", "gather_all", slow=0)
    assert line.startswith(
        "TimeoutError | rank 1 of 2: a collective waited 3 s, the group's limit, and gave up: "
        "the job's store at MASTER_ADDR:MASTER_PORT=127.0.0.1:"
    ), line
    assert "no longer answers either, so rank 0, which hosts it, has stopped answering" in line


def test_a_rank_that_is_only_late_is_told_apart() -> None:
    line = _run("late", "gather_all")
    assert line.startswith(
        "TimeoutError | rank 0 of 2: a collective waited 3 s, the group's limit, and gave up: "
        "every rank still answers (their heartbeats in the job's store at "
        "MASTER_ADDR:MASTER_PORT=127.0.0.1:"
    ), line
    assert "so one is slower than the limit or runs a different collective" in line


def test_a_stalled_worker_of_the_command_line_is_named_in_one_line() -> None:
    command = [sys.executable, "-m", "dataparallel", "train", "--strategy", "ddp"]
    command += ["--nproc-per-node", "2", "--data", "random", "--devices", "cpu"]
    proc = subprocess.Popen(
        [*command, "--epochs", "500"],
        cwd=REPO,
        env=child_env(DATAPARALLEL_DIST_TIMEOUT="8"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stopped = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("epoch 1/500"):
                break
        for pid in _process_tree(proc.pid)[1:]:
            if "RANK=1" in Path(f"/proc/{pid}/environ").read_text().split("\0"):
                stopped = pid
                os.kill(pid, signal.SIGSTOP)
        assert stopped is not None
        _, err = proc.communicate(timeout=120)  # 8 s, a 2 s look, and torch's 30 s close
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):  # the launcher ended it first
                os.kill(stopped, signal.SIGKILL)
    assert proc.returncode == 5, err
    lines = [line for line in err.splitlines() if not line.startswith("[W")]  # torch's C++
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"dataparallel (rank 0): error: rank 0 of 2: a collective waited 8 s, the group's limit, "
        f"and gave up: rank 1 (pid {stopped} on host "
    ), err


def test_a_slow_worker_of_three_is_said_once() -> None:
    """Issue 63, item 6: rank 2 of three only late (its heartbeats move): ranks 0 and 1 both
    said it ("every rank still answers"), and the late rank's heartbeat, beating into the
    store after rank 0 had ended, added 14 lines of torch's C++ log. Now the first rank to
    give up says it, once, and a heartbeat stops quietly when the store's host has ended."""
    script = (
        "import sys; from dataparallel.app.launch import launch; "
        "sys.exit(launch(sys.argv[1:], 3, module='tests.distributed._slow_worker'))"
    )
    args = ["train", "--strategy", "ddp", "--data", "random", "--devices", "cpu", "--epochs", "1"]

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script, *args, "--no-progress"],
            cwd=REPO,
            env=child_env(DATAPARALLEL_DIST_TIMEOUT="3"),
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = run()
    if done.stderr.count("\n") > 1 and "recvValue failed" in done.stderr:
        # One race is left, which no Python code closes: a beat sent after the heartbeat read
        # the store's host as alive, answered by no one because that host was tearing down
        # (a loaded machine's teardown takes long enough to meet a beat; torch's client logs
        # the reset with C++ frames). Seen twice in CI-like runs on a slow day; a heartbeat
        # that beats on into an ended store (the regression this test guards) logs on every
        # run, so it fails the second run too.
        done = run()
    assert done.returncode == 5, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert re.match(
        r"dataparallel \(rank [01]\): error: rank [01] of 3: a collective waited 3 s, the "
        r"group's limit, and gave up: every rank still answers",
        done.stderr,
    ), done.stderr
