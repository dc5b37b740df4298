"""Start ``python -m dataparallel ...`` in one worker per device, as torchrun does.

``launch`` is what ``dataparallel train --strategy ddp`` uses: torch's elastic launcher
(``torch.distributed.launcher.api``) with c10d rendezvous, so it works on one machine (a free
port is picked, never a fixed 29500 that a second job would collide with) and on several (every
node passes the same ``rdzv_endpoint`` and ``rdzv_id``). A failing worker stops the others and
makes ``launch`` return non-zero, with a one-line summary instead of a page of traceback.

Workers never outlive their launcher: each one started here finds the launcher's pid in
``DATAPARALLEL_LAUNCHER_PID`` and calls :func:`watch_launcher`, which ends it within about a
second of the launcher's death, even a ``SIGKILL`` that gives the launcher no chance to clean up.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = [
    "LAUNCHER_PID_ENV",
    "PEER_GONE_EXIT",
    "QUIET_EXIT_CODES",
    "TIMED_OUT_EXIT",
    "free_port",
    "launch",
    "peer_gone",
    "watch_launcher",
]

LAUNCHER_PID_ENV = "DATAPARALLEL_LAUNCHER_PID"
"""Set in each worker's environment to the launcher's pid (see :func:`watch_launcher`)."""

TIMED_OUT_EXIT = 5
"""A worker's exit code when a collective waited past the limit; the lowest rank still
answering said which ranks stopped answering, on one line."""

QUIET_EXIT_CODES = frozenset({2, 3, TIMED_OUT_EXIT, 130, 141})
"""Worker exit codes of the command line that already said why on one line (2 bad input,
3 training stopped, 5 a collective timed out, 130 interrupted, 141 output closed): the
launcher adds nothing."""

PEER_GONE_EXIT = 4
"""A worker's exit code when a collective failed because another worker ended first: the
launcher reports that other worker, never this one."""

# Signals torch's elastic agent handles (and leaves handled) in the launching process.
_HANDLED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, below the range the kernel draws its
    source ports from (its ephemeral range) where one is free there.

    Not a port the kernel picks for ``bind(port 0)``: that one lies in the ephemeral range, and
    a client that retries a connection to it before its server listens (a rank that starts
    before rank 0) can draw the same port as its own source and connect to itself (TCP
    self-connect), then wait for an answer that never comes. Below the range no source port
    is ever drawn. Ports are tried at random from :data:`_LOWEST_PORT` up to the range (read
    from Linux's ``ip_local_port_range``; elsewhere IANA's 49152 on); where none of a few binds,
    the kernel's pick.

    >>> 0 < free_port() < 65536
    True
    """
    low = _ephemeral_low()
    if low > _LOWEST_PORT:
        for port in _RANDOM.sample(range(_LOWEST_PORT, low), min(_TRIES, low - _LOWEST_PORT)):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:  # in use (or held in TIME_WAIT): the next one
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_LOWEST_PORT = 20000  # (well above the ports of common services)
_TRIES = 32
_RANDOM = random.SystemRandom()  # (a program's own seed must not make two runs pick alike)
_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range: Linux's setting, else IANA's 49152."""
    try:
        with open(_PORT_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _positive(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def launch(
    argv: Sequence[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    *,
    module: str = "dataparallel",
) -> int:
    """Run ``python -m <module> <argv>`` in ``nproc_per_node`` workers on this node.

    Each worker gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``), so :func:`dataparallel.distributed.init_distributed`
    joins the job. The calling process's environment is left as it was.

    Args:
        argv: the arguments after ``python -m <module>``.
        nproc_per_node: workers on this node (one per GPU, or a few on the CPU).
        nnodes: number of nodes in the job.
        node_rank: this node's index; c10d rendezvous assigns ranks itself, so it is only
            recorded (nodes may start in any order).
        rdzv_endpoint: ``host:port`` every node can reach (on one of them the rendezvous store
            starts). ``None`` (one node only) picks a free port on 127.0.0.1.
        rdzv_id: the job id, the same on every node; ``None`` is a fresh one (one node only).
        max_restarts: how many times to restart the workers after a failure.
        module: the module to run; ``"dataparallel"`` is the command line.

    Returns:
        0 when every worker succeeded; else the exit code of the first worker that failed
        (128 + N for one killed by signal N), with one line on stderr unless the worker already
        said why (:data:`QUIET_EXIT_CODES`); 128 + N when this process got signal N (the
        workers are stopped first).

    Raises:
        ValueError: a bad count, or several nodes without a shared endpoint and id.
        KeyboardInterrupt: Ctrl-C (SIGINT) to this process, or to one worker alone (the
            message names it), after the workers were stopped.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _positive("nproc_per_node", nproc_per_node, 1)
    _positive("nnodes", nnodes, 1)
    _positive("max_restarts", max_restarts, 0)
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank: expected 0 <= node_rank < nnodes={nnodes}, got {node_rank!r}")
    if nnodes > 1 and (rdzv_endpoint is None or rdzv_id is None):
        raise ValueError(
            f"nnodes={nnodes}: expected rdzv_endpoint='host:port' and rdzv_id shared by every "
            f"node, got rdzv_endpoint={rdzv_endpoint!r}, rdzv_id={rdzv_id!r}; pick a host all "
            f"nodes reach and a job name, and pass both on every node"
        )
    # One node: every store of the job listens on the loopback only (torch's TCPStore binds
    # every interface whatever host it is given, so any machine on the network could reach and
    # write an unauthenticated store). The rendezvous store is ours, on a socket bound to
    # 127.0.0.1 (torch's own rendezvous reuses it: multi-tenant, same port); the job's store is
    # made by rank 0's worker at MASTER_ADDR=127.0.0.1, which init_distributed binds there too,
    # rather than by the agent on every interface (TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
    local = rdzv_endpoint is None
    rendezvous_store = _loopback_store() if local else None
    if rendezvous_store is not None:
        endpoint = f"127.0.0.1:{rendezvous_store[0].getsockname()[1]}"
    else:
        endpoint = str(rdzv_endpoint)
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        run_id=rdzv_id or f"dataparallel-{uuid.uuid4().hex[:12]}",
        rdzv_endpoint=endpoint,
        rdzv_backend=_register_rendezvous(),
        max_restarts=max_restarts,
        monitor_interval=0.1,
        local_addr="127.0.0.1" if local else None,
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException

    saved_env = dict(os.environ)
    # The elastic agent installs its own signal handlers in this process and leaves them.
    saved_handlers = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    # As torchrun does: one OpenMP thread per worker unless asked, or N workers fight over cores.
    if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if local:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        with _quiet_agent_logs():
            elastic_launch(config, entrypoint=sys.executable)("-u", "-m", module, *argv)
    except ChildFailedError as exc:
        return _report_failure(exc)
    except SignalException as exc:
        # The agent turned a signal to this process into an exception, after stopping the
        # workers. Ctrl-C is Python's KeyboardInterrupt; any other signal is 128 + its number.
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        print(
            f"dataparallel launch: stopped by {signal.Signals(exc.sigval).name}; the workers "
            f"were shut down",
            file=sys.stderr,
        )
        return 128 + int(exc.sigval)
    finally:
        # The launcher sets variables of its own (TORCHELASTIC_*) in this process.
        os.environ.clear()
        os.environ.update(saved_env)
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
        if rendezvous_store is not None:
            rendezvous_store[0].close()
    return 0


def _register_rendezvous() -> str:
    """Register torch's c10d rendezvous with one answer changed; its backend name.

    Between two looks at its workers, the agent asks the rendezvous store whether a node waits
    to join. On several nodes that store lives in one node's agent, which leaves as soon as its
    own workers end: after a failure there (it stops the rest and exits), the other nodes'
    question raised ``RendezvousConnectionError`` out of the agent, so their launchers printed a
    page of traceback and returned 1 instead of their own worker's code. A store that can no
    longer be read has no node waiting to join: the answer is 0, and the agent goes on watching
    its own workers, which end (done, or their peer gone) and are reported as on one node.
    """
    from torch.distributed.elastic.rendezvous import registry

    registry.handler_registry.register(_RDZV_BACKEND, _create_handler)
    return _RDZV_BACKEND


_RDZV_BACKEND = "dataparallel-c10d"


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler (``registry._create_c10d_handler``), as :class:`_Handler`."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    handler.__class__ = _handler_class()  # torch builds it; the subclass changes two answers
    return handler


@functools.cache
def _handler_class() -> type:
    """The handler class of ``dataparallel-c10d``, made once (torch is imported lazily here)."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class _Handler(DynamicRendezvousHandler):
        """torch's handler, under our backend's name, answering 0 nodes waiting without a store."""

        def get_backend(self) -> str:
            return _RDZV_BACKEND

        def num_nodes_waiting(self) -> int:
            try:
                return super().num_nodes_waiting()
            except RendezvousConnectionError:
                return 0

    return _Handler


def _loopback_store() -> tuple[socket.socket, object]:
    """A rendezvous store listening on 127.0.0.1 only, on a port of its own choosing.

    The socket is bound here and handed to ``TCPStore`` (``master_listen_fd``); both are kept
    for the launch (the store stops when they are dropped).
    """
    from datetime import timedelta

    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    store = dist.TCPStore(
        "127.0.0.1",
        listener.getsockname()[1],
        is_master=True,
        multi_tenant=True,  # torch's c10d rendezvous asks for the same port: it gets this one
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
        master_listen_fd=listener.fileno(),
    )
    return listener, store


def _report_failure(exc: Exception) -> int:
    """One line on the first failed worker (none where it already said why); the exit code."""
    failures = exc.failures  # type: ignore[attr-defined]
    codes = [f.exitcode for f in failures.values()]
    if 141 in codes:  # rank 0's output was closed (`| head`): end quietly, as the reader wanted
        return 141
    # The first failure that is a cause, not a worker that only lost its peer.
    causes = {r: f for r, f in failures.items() if f.exitcode != PEER_GONE_EXIT} or failures
    # Workers the agent stopped with SIGTERM after the first failure come last on a tie.
    rank = min(causes, key=lambda r: (causes[r].timestamp, causes[r].exitcode == -signal.SIGTERM))
    failure = causes[rank]
    code = failure.exitcode
    if code == 130:  # Ctrl-C to that worker alone (all of them: the agent's SignalException)
        # The worker left the saying to its launcher; said as the launcher's own Ctrl-C is.
        raise KeyboardInterrupt(
            f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) was "
            f"interrupted (SIGINT), and the other workers were stopped"
        )
    if code in QUIET_EXIT_CODES:
        return int(code)
    where = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    if code < 0:
        what = (
            f"was killed by {_signal_name(-code)} and printed no traceback (it was ended from "
            f"outside: out of memory, `kill`, or a signal to its group)"
        )
    else:
        what = f"exited with code {code}; see its output above"
    print(
        f"dataparallel launch: {len(failures)} worker(s) failed; first: {where} {what}",
        file=sys.stderr,
    )
    return code if code > 0 else 128 - code


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _quiet_agent_logs:
    """Silence torch's elastic loggers for the launch: their lines ("Received SIGINT death
    signal, shutting down workers", "failed (exitcode: 1) local_rank: 0 ...") repeat what the
    one-line summary says."""

    def __enter__(self) -> None:
        import logging

        self._saved: dict[str, int] = {}
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logger = logging.getLogger(name)
                self._saved[name] = logger.level
                logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc: object) -> None:
        import logging

        for name, level in self._saved.items():
            logging.getLogger(name).setLevel(level)


_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
)


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another worker of the job ended first.

    Its cause is that worker's, which the launcher reports; this one's traceback is noise.
    """
    import torch.distributed as dist

    kinds: tuple[type[BaseException], ...] = (RuntimeError,)
    if hasattr(dist, "DistError"):
        kinds = (RuntimeError, dist.DistError)
    if getattr(exc, "peer_gone", False):  # (the rendezvous's StoreClosed)
        return True
    return isinstance(exc, kinds) and any(text in str(exc) for text in _PEER_GONE)


def watch_launcher(launcher_pid: int | None = None) -> bool:
    """End this worker when its launcher dies: called first thing in each launched worker.

    On Linux the kernel sends SIGTERM to this process when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread polls ``os.getppid()`` twice a
    second. Either way a ``SIGKILL`` of the launcher leaves no worker running for more than
    about a second. If the launcher is already gone, this process ends at once.

    Args:
        launcher_pid: the launcher's pid; ``None`` reads ``DATAPARALLEL_LAUNCHER_PID`` and does
            nothing when it is unset (a worker started by torchrun, which watches its own).

    Returns:
        Whether a watch was set up.
    """
    if launcher_pid is None:
        text = os.environ.get(LAUNCHER_PID_ENV, "")
        if not text.isdigit():
            return False
        launcher_pid = int(text)
    if not (sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGTERM)):
        watcher = threading.Thread(
            target=_poll_parent, args=(launcher_pid,), name="dataparallel-watch", daemon=True
        )
        watcher.start()
    if os.getppid() != launcher_pid:  # it died before the watch was set
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _set_parent_death_signal(sig: int) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(1, int(sig), 0, 0, 0) == 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _poll_parent(launcher_pid: int) -> None:
    import time

    while os.getppid() == launcher_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
