"""How ``dataparallel train`` ends when it is interrupted, killed or loses its reader: real
processes and real signals, each wait bounded.

- Ctrl-C (SIGINT to the process group, as a terminal sends it): one line, status 130, the last
  complete checkpoint kept, no temp file left, no worker left.
- ``| head`` (the reader closes the pipe): no output on stderr, status 141.
- SIGKILL of the ddp launcher: its workers end within seconds.
- A worker killed from outside: the launcher says so, and does not send anyone looking for a
  traceback that was never printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataparallel.app.demo.checkpoint import load_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for workers"),
]

TRAIN = [sys.executable, "-m", "dataparallel", "train", "--data", "random", "--epochs", "100000"]
DDP = ["--strategy", "ddp", "--nproc-per-node", "2", "--devices", "cpu"]


def _without_store_resets(err: str) -> str:
    """``err`` less what torch's C++ store client logs when a worker's store call meets the
    store's host ending: its line and the C++ frames under it. That is the teardown race
    ``test_stalls`` names, which no Python code closes: the heartbeat reads its watch on the
    store before each beat, but a beat already sent when rank 0 ends (Ctrl-C reaches every
    process at once) is reset. Under load it met two runs in a row of the closed-reader test
    (a local CI run, newest torch, stop 76), and the Ctrl-C test in the landing run of stop 76,
    so a retry did not keep these tests to one answer. Anything else on stderr (a traceback, a
    line of ours: the regressions these tests guard) is kept, each line with its newline."""
    kept: list[str] = []
    skipping = False
    for line in err.splitlines():
        if "recvValue failed" in line and "TCPStore" in line:
            skipping = True
            continue
        frame = line.startswith(("Exception raised from", "frame #", "<omitting python frames>"))
        if skipping and (frame or not line.strip()):
            continue
        skipping = False
        kept.append(line)
    return "".join(f"{line}\n" for line in kept)


def _start(argv: list[str], tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be read


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _first_epoch(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("epoch 1/"), line + (proc.stderr.read() if proc.stderr else "")
    return line


def _workers(proc: subprocess.Popen[str], count: int) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = _children(proc.pid)
        if len(kids) >= count:
            return kids
        time.sleep(0.1)
    raise AssertionError(f"expected {count} workers under pid {proc.pid}, got {kids}")


@pytest.fixture
def reap() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test started: killed with their group if the test failed half-way."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def test_ctrl_c_in_dp_keeps_the_last_checkpoint(
    tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    ckpt = tmp_path / "run.pt"
    proc = _start([*TRAIN, "--checkpoint", str(ckpt)], tmp_path)
    reap.append(proc)
    _first_epoch(proc)  # printed after the epoch's checkpoint is written
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.count("\n") == 1 and err.startswith("dataparallel: interrupted"), err
    assert "--resume" in err
    assert load_checkpoint(ckpt)["epoch"] >= 1
    assert [p.name for p in tmp_path.iterdir()] == ["run.pt"]  # no temp file left


def test_ctrl_c_in_ddp_ends_every_process_with_130(
    tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    proc = _start([*TRAIN, *DDP], tmp_path)
    reap.append(proc)
    _first_epoch(proc)
    workers = _workers(proc, 2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert _without_store_resets(err) == "dataparallel: interrupted\n", err
    assert _wait_gone(workers, 30) == []


def test_sigkill_of_the_launcher_ends_its_workers(
    tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    proc = _start([*TRAIN, *DDP], tmp_path)
    reap.append(proc)
    _first_epoch(proc)
    workers = _workers(proc, 2)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: no chance to clean up
    proc.communicate(timeout=30)
    assert _wait_gone(workers, 30) == [], "workers outlived their launcher"


def test_a_worker_killed_from_outside_is_reported_as_killed(
    tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    proc = _start([*TRAIN, *DDP], tmp_path)
    reap.append(proc)
    _first_epoch(proc)
    workers = _workers(proc, 2)
    os.kill(max(workers), signal.SIGKILL)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGKILL, err
    last = err.strip().splitlines()[-1]
    assert "killed by SIGKILL" in last and "printed no traceback" in last, err
    assert "traceback above" not in err and "Traceback" not in err
    assert _wait_gone(workers, 30) == []


@pytest.mark.parametrize(
    "argv",
    [
        [*TRAIN],
        [*TRAIN, *DDP],
        [sys.executable, "-m", "dataparallel", "explain"],
    ],
    ids=["train dp", "train ddp", "explain"],
)
def test_a_closed_reader_ends_the_run_quietly(
    argv: list[str], tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    def run() -> tuple[int, str]:
        proc = _start(argv, tmp_path)
        reap.append(proc)
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()  # `| head -1`: one line read, then the pipe closes
        proc.stdout.close()
        err = proc.stderr.read()
        return proc.wait(timeout=90), err

    code, err = run()
    err = _without_store_resets(err)
    if argv[-1] == "explain":
        # explain prints about 6 KB, which fits in the pipe's buffer: it may have written all of
        # it (exit 0) before the reader closed, or hit the closed pipe (141). Quiet either way.
        assert code in (0, 141), err
    else:  # training prints for seconds: it always meets the closed pipe
        assert code == 141, err
    assert err == ""


def test_ctrl_c_to_one_worker_is_said_in_one_line(
    tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    """Issue 63, item 9: SIGINT to one worker alone ended the job with 130 and nothing on
    stderr (the worker leaves the saying to its launcher, which said nothing)."""
    ckpt = tmp_path / "run.pt"
    proc = _start([*TRAIN, *DDP, "--checkpoint", str(ckpt)], tmp_path)
    reap.append(proc)
    _first_epoch(proc)
    workers = _workers(proc, 2)
    os.kill(max(workers), signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    err = _without_store_resets(err)
    assert err.count("\n") == 1, err
    assert err.startswith("dataparallel: interrupted; worker rank "), err
    assert f"was interrupted (SIGINT), and the other workers were stopped; {ckpt} keeps " in err
    assert _wait_gone(workers, 30) == []
