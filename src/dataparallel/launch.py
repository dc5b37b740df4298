"""Start ``python -m dataparallel ...`` in one worker per device, as torchrun does.

``launch`` is what ``dataparallel train --strategy ddp`` uses: torch's elastic launcher
(``torch.distributed.launcher.api``) with c10d rendezvous, so it works on one machine (a free
port is picked, never a fixed 29500 that a second job would collide with) and on several (every
node passes the same ``rdzv_endpoint`` and ``rdzv_id``). A failing worker stops the others and
makes ``launch`` return non-zero, with a one-line summary instead of a page of traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid
from collections.abc import Sequence

__all__ = ["free_port", "launch"]

# Signals torch's elastic agent handles (and leaves handled) in the launching process.
_HANDLED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bound to port 0, then released).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
        0 when every worker succeeded, else the first failed worker's exit code (1 if it had
        none).

    Raises:
        ValueError: a bad count, or several nodes without a shared endpoint and id.
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
    endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        run_id=rdzv_id or f"dataparallel-{uuid.uuid4().hex[:12]}",
        rdzv_endpoint=endpoint,
        rdzv_backend="c10d",
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    saved_env = dict(os.environ)
    # The elastic agent installs its own signal handlers in this process and leaves them.
    saved_handlers = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    # As torchrun does: one OpenMP thread per worker unless asked, or N workers fight over cores.
    if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        elastic_launch(config, entrypoint=sys.executable)("-u", "-m", module, *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode or 1
        print(
            f"dataparallel launch: {len(exc.failures)} worker(s) failed; first: rank {rank} "
            f"(local rank {failure.local_rank}, pid {failure.pid}) exited with code "
            f"{failure.exitcode}{_signal_note(failure.exitcode)}; see its traceback above",
            file=sys.stderr,
        )
        return code if code > 0 else 1
    finally:
        # The launcher sets variables of its own (TORCHELASTIC_*) in this process.
        os.environ.clear()
        os.environ.update(saved_env)
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
    return 0


def _signal_note(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f" (signal {signal.Signals(-exitcode).name})"
        except ValueError:
            return f" (signal {-exitcode})"
    return ""
