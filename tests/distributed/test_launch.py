"""The launchers: two "nodes" on localhost, and a failing rank that must end the whole job."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataparallel.app.launch import free_port, launch

from ._helpers import REPO, child_env

# The module itself (the package's ``launch`` is the function of that name).
launch_module = importlib.import_module("dataparallel.app.launch")

JOB = "tests.distributed._job"


def _launch_code(argv: list[str], nproc: int, **kwargs: object) -> str:
    """A ``python -c`` program that runs our launch() and exits with its result."""
    options = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return (
        "import sys\nfrom dataparallel.app.launch import launch\n"
        f"sys.exit(launch({argv!r}, {nproc}{options}, module={JOB!r}))\n"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its (dead) parent to be reaped is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_nodes_on_localhost(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    node0 = [
        sys.executable,
        "-c",
        _launch_code(
            ["train", str(tmp_path)],
            1,
            nnodes=2,
            node_rank=0,
            rdzv_endpoint=endpoint,
            rdzv_id="two-nodes",
        ),
    ]
    node1 = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "two-nodes",
        "--node-rank",
        "1",
        "-m",
        JOB,
        "train",
        str(tmp_path),
    ]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for cmd in (node0, node1)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n-----\n".join(outputs)
    assert sorted(f.read_text() for f in tmp_path.glob("ok-*")) == ["2 0", "2 0"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failing_rank_ends_the_job_and_leaves_no_process(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _launch_code(["fail", str(tmp_path)], 2)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stderr
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after a rank failed"
    assert "rank 1 fails on purpose" in proc.stderr
    assert (
        "dataparallel launch: " in proc.stderr and "worker(s) failed; first: rank 1" in proc.stderr
    )
    pids = [int(f.read_text()) for f in sorted(tmp_path.glob("pid-*"))]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _pid_alive(pid)] == []


def test_launch_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nproc_per_node: expected an int >= 1, got 0"):
        launch(["train"], 0)
    with pytest.raises(
        ValueError, match=r"nnodes=2: expected rdzv_endpoint='host:port' and rdzv_id"
    ):
        launch(["train"], 1, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="node_rank: expected 0 <= node_rank < nnodes=1, got 1"):
        launch(["train"], 1, node_rank=1)


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert port != 29500
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_lies_below_the_kernels_source_ports() -> None:
    """A client retrying a connection to a port in the ephemeral range can draw it as its own
    source port and connect to itself; ``free_port`` used to return one from there."""
    low = launch_module._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(launch_module._LOWEST_PORT <= port < low for port in ports), (low, ports)
    assert len(ports) > 1  # drawn at random: two launchers rarely pick alike


def test_free_port_falls_back_to_the_kernels_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """No room below the range (or every try taken): the kernel's pick, which binds."""
    monkeypatch.setattr(launch_module, "_ephemeral_low", lambda: launch_module._LOWEST_PORT)
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", launch_module._LOWEST_PORT))
    except OSError:
        taken.close()
        return  # (the one port is in use here already: the case holds as it is)
    with taken:
        monkeypatch.setattr(launch_module, "_ephemeral_low", lambda: launch_module._LOWEST_PORT + 1)
        assert free_port() != launch_module._LOWEST_PORT


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_error_on_one_node_only_is_said_once_by_its_rank(tmp_path: Path) -> None:
    # The checkpoint is on node 0's disk only: the rank on node 1 cannot resume. It used to end
    # without a word while rank 0 printed "resumed from" and a raw gloo traceback.
    from dataparallel.app.cli import main
    from dataparallel.app.demo.checkpoint import load_checkpoint, save_checkpoint

    disks = [tmp_path / "node0", tmp_path / "node1"]
    for disk in disks:
        disk.mkdir()
    ckpt = disks[0] / "ck.pt"
    assert main(["train", "--data", "random", "--epochs", "1", "--checkpoint", str(ckpt)]) == 0
    state = load_checkpoint(ckpt)
    state["config"]["layout"] = {"strategy": "ddp", "world_size": 2}  # as a 2-process run's
    save_checkpoint(ckpt, state)
    argv = ["train", "--data", "random", "--strategy", "ddp", "--devices", "cpu"]
    argv += ["--epochs", "2", "--checkpoint", "ck.pt", "--resume"]
    endpoint = f"127.0.0.1:{free_port()}"
    code = (
        "import sys\nfrom dataparallel.app.launch import launch\n"
        f"sys.exit(launch({argv!r}, 1, nnodes=2, node_rank=int(sys.argv[1]), "
        f"rdzv_endpoint={endpoint!r}, rdzv_id='one-disk'))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(node)],
            cwd=disks[node],
            env=child_env(PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)])),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n-----\n".join(outputs)
    assert [p.returncode for p in procs] == [2, 2], text
    errors = [line for output in outputs for line in output.splitlines() if "error" in line]
    assert len(errors) == 1, text
    assert errors[0].startswith("dataparallel (rank "), text
    assert "): error: --checkpoint 'ck.pt': no such file to resume from" in errors[0]
    assert "Traceback" not in text and "resumed from" not in text, text


@pytest.mark.timeout(60)
def test_a_node_whose_rendezvous_store_is_gone_hears_of_no_node_waiting() -> None:
    # On several nodes the store lives in one node's agent, which leaves when its workers end.
    # The other agents ask it between two looks at their workers; that question used to raise
    # out of the agent (a traceback and exit 1 on that node, not its worker's own code).
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
        registry,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from dataparallel.app.launch import _register_rendezvous

    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\ntime.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        params = RendezvousParameters(
            backend=_register_rendezvous(),
            endpoint=f"127.0.0.1:{port}",
            run_id="store-gone",
            min_nodes=2,
            max_nodes=2,
            is_host=False,
        )
        handler = registry.get_rendezvous_handler(params)
        assert handler.num_nodes_waiting() == 0
    finally:
        host.kill()
        host.wait()
    time.sleep(1.5)  # the handler answers from its last read for 1 s (torch's cache_duration)
    assert handler.num_nodes_waiting() == 0
    with pytest.raises(RendezvousConnectionError):  # torch's own answer, which the agent raised
        DynamicRendezvousHandler.num_nodes_waiting(handler)


def _process_tree(pid: int) -> list[int]:
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found += _process_tree(int(child))
    return found


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """The (address, pid) of every listening TCP socket the processes hold (from /proc).

    The tables are read from the first process's own ``/proc/<pid>/net``: in a network
    namespace of the test's own, the test's ``/proc/net`` shows the host's sockets instead.
    """
    owners: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[target[8:-1]] = pid
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pids[0]}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owners:  # 0A: LISTEN
                found.append((fields[1], owners[fields[9]]))
    return found


def _loopback(address: str) -> bool:
    host = address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian hex
        return host.endswith("7F")
    return host in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def _own_network(command: list[str]) -> list[str] | None:
    """``command`` in a network and host-name namespace of its own whose host name is a
    non-loopback address (192.0.2.2, TEST-NET-1, on its loopback device), as on a real host
    whose name resolves to its LAN address; no packet leaves the machine. ``None`` where the
    namespace cannot be made (not Linux, no ``unshare``/``ip``, no privilege)."""
    setup = "ip link set lo up && ip addr add 192.0.2.2/32 dev lo && hostname 192.0.2.2"
    wrapped = ["unshare", "--net", "--uts", "sh", "-c", f'{setup} && exec "$@"', "sh", *command]
    try:
        probe = subprocess.run(
            [*wrapped[: -len(command)], "true"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return wrapped if probe.returncode == 0 else None


def _job_sockets(command: list[str], processes: int) -> tuple[int, list[tuple[str, int]]]:
    """Run a one-node job until its first epoch: its launcher's pid, and the listening sockets
    of its processes as (address, pid).

    The job is stopped with SIGINT, and killed if it outlives that by a minute.
    """
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # the first epoch's line: every store and socket is up
            lines.append(line)
            if line.startswith("epoch 1/500"):
                break
        pids = _process_tree(proc.pid)
        sockets = _listening(pids)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert len(pids) == processes, lines  # the launcher and its workers
    assert proc.pid in {pid for _, pid in sockets}, sockets  # the rendezvous store
    return proc.pid, sockets


_ONE_NODE_TRAIN = ["train", "--data", "random", "--strategy", "ddp", "--devices", "cpu"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("host", ["this host", "host named by a LAN address"])
def test_a_one_node_job_listens_on_the_loopback_only(host: str) -> None:
    # torch's TCPStore listens on every interface: the launcher's two stores took writes
    # from any host on the network while the job ran. gloo's sockets listen where the host's
    # name resolves: on most real hosts, their LAN address (issue 51, item 8).
    command = [sys.executable, "-m", "dataparallel", *_ONE_NODE_TRAIN, "--epochs", "500"]
    command += ["--nproc-per-node", "2"]
    if host != "this host":
        wrapped = _own_network(command)
        if wrapped is None:
            pytest.skip("no network namespace here (needs unshare, ip and the privilege)")
        command = wrapped
    _, sockets = _job_sockets(command, 3)
    assert len({pid for _, pid in sockets}) == 3, sockets  # rank 0's store, both gloo meshes
    assert [s for s in sockets if not _loopback(s[0])] == [], sockets


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")
def test_the_guides_torchrun_command_exposes_only_the_agents_two_stores() -> None:
    # The guide's one-machine torchrun command, on a host whose name is its LAN address: the
    # workers listen on the loopback only; torchrun's agent keeps two stores on every
    # interface, which no torchrun option changes, and the guide says so at the command.
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "dataparallel", *_ONE_NODE_TRAIN]
    wrapped = _own_network([*command, "--epochs", "500"])
    if wrapped is None:
        pytest.skip("no network namespace here (needs unshare, ip and the privilege)")
    agent, sockets = _job_sockets(wrapped, 3)
    exposed = [s for s in sockets if not _loopback(s[0])]
    workers = {pid for _, pid in sockets} - {agent}
    assert len(workers) == 2, sockets  # both workers listen (gloo), on the loopback only
    assert [pid for _, pid in exposed] == [agent, agent], sockets  # torchrun's two stores
    assert all(s[0].startswith("0" * 32) for s in exposed), sockets  # [::]: every interface
