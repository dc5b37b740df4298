"""Meeting the other ranks: the endpoint checked, a timeout on everything, torch's errors named.

torch reads ``MASTER_ADDR`` and ``MASTER_PORT`` itself and fails with raw messages (``invalid
literal for int()``) or, worse, waits: its default timeout is 30 minutes, an unresolvable host
retries for all of it, and a rank whose ``MASTER_PORT`` is held by another program connects to
that program and waits for an answer that never comes, past any timeout. Here the endpoint is
checked first (:func:`master_endpoint`), every wait is bounded (:func:`resolve_timeout`, passed
to ``init_process_group``, which also bounds gloo's collectives), and what torch raises while
the ranks meet is said in our words (:func:`init_process_group`): which variable, what was
found, what was expected, and how to fix it. The job's store is made once per process and each
session meets under its own prefix in it (repeated sessions never meet a stale store), and a
store on a loopback ``MASTER_ADDR`` listens on the loopback only.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import math
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dataparallel.distributed import _liveness

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "gloo_on_loopback",
    "init_process_group",
    "master_endpoint",
    "resolve_timeout",
]

#: The default limit, in seconds, on meeting the other ranks and on each collective.
DEFAULT_TIMEOUT_S = 300.0

#: The environment variable that changes the default limit (seconds), e.g. for a CLI run.
TIMEOUT_ENV = "DATAPARALLEL_DIST_TIMEOUT"

#: The limits a timeout must fall in: torch's stores and gloo count milliseconds (less than one
#: would round to 0, "waited 0 s"), and hand them to C as a 32-bit int (more overflows).
MIN_TIMEOUT_S = 0.001
MAX_TIMEOUT_S = (2**31 - 1) / 1000  # about 24.8 days

_ENDPOINT_FIX = (
    "set MASTER_ADDR to the rank-0 host's name or IP address and MASTER_PORT to a free port "
    "there, the same on every rank (torchrun --master-addr/--master-port, or --rdzv-endpoint); "
    "on one machine, 127.0.0.1 and any free port (`dataparallel train --strategy ddp` picks one)"
)


def resolve_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    """The limit on meeting the other ranks and on each collective.

    ``timeout`` as given (seconds, or a ``timedelta``), else ``DATAPARALLEL_DIST_TIMEOUT``
    (seconds), else :data:`DEFAULT_TIMEOUT_S` (5 minutes, where torch waits 30).

    Raises:
        ValueError: not a number of seconds from :data:`MIN_TIMEOUT_S` to
            :data:`MAX_TIMEOUT_S` (the message names where it came from).
    """
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
        where, found = f"environment variable {TIMEOUT_ENV}", repr(raw)
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
    else:
        where, found = "timeout", repr(timeout)
        if isinstance(timeout, datetime.timedelta):
            seconds = timeout.total_seconds()
        elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            seconds = float(timeout)
        else:
            seconds = math.nan
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:  # (NaN fails it too)
        raise ValueError(
            f"{where}: expected a positive, finite number of seconds from {MIN_TIMEOUT_S:g} to "
            f"{MAX_TIMEOUT_S:,.0f}, got {found}; pass e.g. timeout=600 (or a "
            f"datetime.timedelta), or set {TIMEOUT_ENV}=600"
        )
    return datetime.timedelta(seconds=seconds)


def master_endpoint() -> tuple[str, int]:
    """``MASTER_ADDR`` and ``MASTER_PORT``, checked: a resolvable host and a port number.

    Raises:
        ValueError: the port is not an integer from 1 to 65535, or the host does not resolve
            (an unresolvable host would otherwise be retried until the timeout).
    """
    addr, raw_port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    try:
        port = int(raw_port)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(
            f"environment variable MASTER_PORT: expected an integer port from 1 to 65535, got "
            f"{raw_port!r}; {_ENDPOINT_FIX}"
        )
    if not addr.strip():
        raise ValueError(
            f"environment variable MASTER_ADDR: expected a host, got {addr!r}; {_ENDPOINT_FIX}"
        )
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(
            f"environment variable MASTER_ADDR: expected a host name or address this machine "
            f"can resolve, got {addr!r} ({exc}); {_ENDPOINT_FIX}"
        ) from None
    return addr, port


def _agent_hosts_store() -> bool:
    """Whether torchrun's agent hosts the job's store, so every rank (rank 0 too) is a client."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _first_line(exc: BaseException) -> str:
    """What torch said, for our message: its first line, less the store keys a wait names
    (``wait timeout after 3000ms, keys: /dataparallel/attempt-0/session-0/0//cpu//0/1``),
    which are torch's own rendezvous paths, nothing the user set or can act on."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line.split(", keys: ", 1)[0]


def _timed_out(where: str, rank: int, world_size: int, seconds: float, cause: str) -> TimeoutError:
    return TimeoutError(
        f"init_distributed: rank {rank} of {world_size} waited {seconds:g} s for the other ranks "
        f"at MASTER_ADDR:MASTER_PORT={where} and gave up ({cause}); expected all {world_size} "
        f"processes to start and reach that endpoint; check that every rank was started with "
        f"the same MASTER_ADDR and MASTER_PORT and that the host is reachable, or wait longer "
        f"with init_distributed(timeout=seconds), ddp_session(model, timeout=seconds) or "
        f"{TIMEOUT_ENV}=seconds"
    )


#: How long past its own limit torch's client is given before the probe looks for itself.
_PROBE_SLACK_S = 5.0


def _accepts(addr: str, port: int) -> bool:
    """Whether a program accepts connections at ``addr:port`` now: observed with one connect,
    so that a probe still waiting is told apart as "nobody there" or "a program that does not
    answer", not guessed from how long it waited."""
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:  # refused, unreachable or no answer within the second
        return False


def _probe_store(addr: str, port: int, rank: int, world_size: int, seconds: float) -> None:
    """Connect to the job's store as a client before torch does, and bound the wait.

    A program other than a store that holds ``MASTER_PORT`` accepts the connection and never
    answers; torch's client then waits past its own timeout. The probe runs in a daemon thread
    that the caller leaves behind once the limit has passed, with our error.
    """
    failure: list[BaseException] = []

    def connect() -> None:
        try:
            store = dist.TCPStore(
                addr,
                port,
                world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=seconds),
                wait_for_workers=False,
            )
            del store
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=connect, name="store-probe", daemon=True)
    thread.start()
    thread.join(seconds + _PROBE_SLACK_S)  # torch's own connect timeout first, then ours
    where = f"{addr}:{port}"
    if thread.is_alive() and not _accepts(addr, port):
        # torch's client overran its own limit (its retries back off past it: 3.5 to 5.6 s for
        # 2 s, measured), and nothing listens there: a wait for ranks that never came
        raise _timed_out(where, rank, world_size, seconds, "nothing listens there")
    if thread.is_alive():
        raise TimeoutError(
            f"init_distributed: rank {rank} of {world_size} reached MASTER_ADDR:MASTER_PORT="
            f"{where}, but no torch.distributed store answered there within {seconds:g} s: "
            f"expected rank 0's store (or torchrun's) at that endpoint, found a program that "
            f"accepts connections and does not answer (another program holds the port, or "
            f"rank 0 is stuck); {_ENDPOINT_FIX}"
        )
    if failure:
        exc = failure[0]
        if isinstance(exc, (dist.DistError, RuntimeError)) and "timed out" in str(exc).lower():
            raise _timed_out(where, rank, world_size, seconds, _first_line(exc)) from None
        raise exc


# The job's store, one per endpoint, kept for the life of the process, and how many sessions
# each has started: every session's group lives under its own key prefix in it.
_STORES: dict[tuple[str, int, int, int], list[Any]] = {}


def _loopback_listener(addr: str, port: int) -> socket.socket | None:
    """A socket listening on ``addr:port`` when ``addr`` is a loopback address, else ``None``.

    torch's ``TCPStore`` listens on every interface whatever host it is given, so a one-machine
    job (``MASTER_ADDR=127.0.0.1``) would take writes from any host on the network. Given this
    socket (``master_listen_fd``), the store listens where ``MASTER_ADDR`` says. A job across
    machines names a reachable address, and keeps torch's binding.

    Raises:
        RuntimeError: the port is in use (our message, naming ``MASTER_PORT``).
    """
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    if not _all_loopback(addr):
        return None
    family, kind, proto, _, sockaddr = infos[0]
    listener = socket.socket(family, kind, proto)
    try:
        # As torch's own store listens: a port whose last job's connections linger in
        # TIME_WAIT is free to bind again at once (and those connections, which inherit the
        # option, leave it free for a plain torch store too). A program that still listens
        # there still holds it: SO_REUSEADDR never shares a listening port on Linux.
        if os.name != "nt":  # (on Windows the option would share a port another holds)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen()
    except OSError as exc:
        listener.close()
        found = (
            "in use by another program"
            if exc.errno == errno.EADDRINUSE
            else f"not usable ({exc.strerror})"
        )
        raise RuntimeError(
            f"environment variable MASTER_PORT: rank 0 cannot listen on {addr}:{port}: expected "
            f"a free port, found it {found}; choose a free port (torchrun --master-port), or let "
            f"`dataparallel train --strategy ddp` pick one"
        ) from None
    return listener


def _all_loopback(addr: str) -> bool:
    """Whether ``addr`` resolves, and only to loopback addresses."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(_is_loopback(str(i[4][0])) for i in infos)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _check_own_job(store: dist.Store, where: str, rank: int, world_size: int) -> None:
    """Refuse a store that belongs to another job, before any group is made in it.

    A second job started on a running job's ``MASTER_PORT``: its rank 0 cannot listen there
    (our error), but its other ranks reach the running job's store, which answers, and then
    would wait in that job's gloo rendezvous past their limit, or join its mesh and break it.
    Every rank that joins a store counts itself in under its rank (and torchrun's restart
    attempt), and the first to join sets the job's size: a rank that is the second of its
    number, or finds another size, is in the wrong job's store, or its job's ranks disagree on
    ``WORLD_SIZE``: rank 0, which hosts the store, knows it is the latter, and a rank that finds
    another size leaves a word in the store for the ranks already waiting (:func:`_refusals`).

    Raises:
        RuntimeError: naming the endpoint, what was found there, and the fix.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"dataparallel/attempt-{attempt}"
    size = store.compare_set(f"{prefix}/world-size", "", str(world_size)).decode()
    joined = store.add(f"{prefix}/joined/rank-{rank}", 1)
    if size == str(world_size) and joined == 1:
        return
    if size != str(world_size) and joined == 1:
        # Told to the rank already waiting in torch's rendezvous, which reads it when its
        # wait ends (see _refusals).
        count = store.add(f"{prefix}/refused", 1)
        store.set(f"{prefix}/refused/{count}", f"rank {rank} has WORLD_SIZE={world_size}")
        if rank == 0 and not _agent_hosts_store():
            # Rank 0 hosts the store: the rank that set the size is of this very job.
            raise RuntimeError(
                f"environment variable WORLD_SIZE: rank 0 has WORLD_SIZE={world_size}, and "
                f"another rank of this job reached its store at MASTER_ADDR:MASTER_PORT="
                f"{where} with WORLD_SIZE={size}: expected the same WORLD_SIZE on every rank; "
                f"start every rank with the same WORLD_SIZE (torchrun sets it from --nnodes "
                f"and --nproc-per-node)"
            )
    found = (
        f"a job of {size} processes), or this job's ranks were started with different "
        f"WORLD_SIZE (this rank has {world_size}"
        if size != str(world_size)
        else f"its rank {rank} has already joined"
    )
    raise RuntimeError(
        f"environment variable MASTER_PORT: rank {rank} of {world_size} reached the store at "
        f"MASTER_ADDR:MASTER_PORT={where} and found another job there ({found}); expected "
        f"this job's own store, with no rank {rank} yet: two jobs cannot share one endpoint; "
        f"give each job its own MASTER_PORT (torchrun --master-port), or let `dataparallel "
        f"train --strategy ddp` pick a free one"
    )


def _job_store(
    addr: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> tuple[dist.Store, int]:
    """The job's store at ``addr:port`` and this session's number in it.

    Made once per process, as ``env://`` makes it (rank 0 hosts it, unless torchrun's agent
    does), and kept: a second session then meets the others in the same store under a fresh
    prefix. Made anew per session, a rank that tore down its first session early connected to
    rank 0's first store, not yet closed, and waited there on the first session's keys (the
    repeated-session hang). Every rank runs the same sessions in the same order, so the
    numbers agree.
    """
    key = (addr, port, rank, world_size)
    entry = _STORES.get(key)
    if entry is None:
        if rank != 0 or _agent_hosts_store():
            _probe_store(addr, port, rank, world_size, timeout.total_seconds())
        master = rank == 0 and not _agent_hosts_store()
        listener = _loopback_listener(addr, port) if master else None
        store = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=master,
            timeout=timeout,
            multi_tenant=True,  # as env:// makes it: torch's own env:// later reuses it
            # The ranks are awaited in the rendezvous, after _check_own_job: a rank started
            # with another WORLD_SIZE is then named, where the host's count of clients
            # only timed out ("2/3 clients joined").
            wait_for_workers=False,
            master_listen_fd=None if listener is None else listener.fileno(),
        )
        _check_own_job(store, f"{addr}:{port}", rank, world_size)
        entry = _STORES[key] = [store, 0, listener]
    else:
        entry[0].set_timeout(timeout)
    session = entry[1]
    entry[1] += 1
    return entry[0], session


def _loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux), or ``None``."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        flags = Path(f"/sys/class/net/{name}/flags")
        try:
            if int(flags.read_text(), 16) & 0x8:  # IFF_LOOPBACK
                return name
        except (OSError, ValueError):
            continue
    return next((name for name in names if name in ("lo", "lo0")), None)


@contextmanager
def gloo_on_loopback(addr: str) -> Iterator[None]:
    """While a gloo group is made, have it listen on the loopback in a one-node job.

    gloo listens where this host's name resolves: on most real hosts, the LAN address, so a
    job that never leaves the machine would take connections from the network. Every rank of
    a one-node job (a loopback ``MASTER_ADDR``, or torchrun's ``LOCAL_WORLD_SIZE`` equal to
    ``WORLD_SIZE``) reaches the others on the loopback. ``GLOO_SOCKET_IFNAME``, which gloo
    reads when the group is made, names the loopback interface for the length of the block and
    is then restored; one the user set is kept.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE")
    one_node = _all_loopback(addr) or (local is not None and local == os.environ.get("WORLD_SIZE"))
    interface = _loopback_interface() if one_node else None
    if "GLOO_SOCKET_IFNAME" in os.environ or interface is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def init_process_group(
    backend: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> None:
    """``torch.distributed.init_process_group`` over ``env://``'s store, with the endpoint
    checked, a bounded wait, torch's rendezvous errors (port in use, timed out) in our words,
    and each session of the process under its own prefix in one store (:func:`_job_store`).

    Raises:
        ValueError: ``MASTER_ADDR`` or ``MASTER_PORT`` is unusable (see :func:`master_endpoint`).
        RuntimeError: rank 0 cannot listen on ``MASTER_PORT`` (another program holds it).
        TimeoutError: the other ranks did not all arrive within ``timeout``.
    """
    addr, port = master_endpoint()
    seconds = timeout.total_seconds()
    where = f"{addr}:{port}"
    try:
        store, session = _job_store(addr, port, rank, world_size, timeout)
        # torchrun's agent keeps its store across restarts: the workers it restarts (their
        # sessions numbered from 0 again) meet under their attempt's prefix, as env:// does,
        # never at the dead workers' addresses.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"dataparallel/attempt-{attempt}/session-{session}"
        with gloo_on_loopback(addr) if "gloo" in backend else nullcontext():
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(prefix, store),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        _liveness.start(addr, port, rank, world_size, prefix, seconds)
    except (dist.DistError, RuntimeError) as exc:
        text = str(exc)
        refused = _refusals((addr, port, rank, world_size), where)
        if refused is not None:
            raise RuntimeError(refused) from None
        if any(words in text for words in _STORE_CLOSED):
            raise StoreClosed(
                f"init_distributed: rank {rank} of {world_size}: the job's store at "
                f"MASTER_ADDR:MASTER_PORT={where} closed while this rank waited for the others "
                f"({_first_line(exc)}): rank 0, which hosts it, has ended; its own error says "
                f"why (such as another WORLD_SIZE than this rank's {world_size}); expected "
                f"every rank to meet there; start every rank with the same MASTER_ADDR, "
                f"MASTER_PORT and WORLD_SIZE"
            ) from None
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise RuntimeError(
                f"environment variable MASTER_PORT: rank 0 cannot listen on {where}: expected a "
                f"free port, found it in use by another program; choose a free port (torchrun "
                f"--master-port), or let `dataparallel train --strategy ddp` pick one"
            ) from None
        if any(words in text.lower() for words in ("timed out", "wait timeout")) or (
            "clients joined" in text
        ):
            raise _timed_out(where, rank, world_size, seconds, _first_line(exc)) from None
        raise


# What torch says when the store's host went away during the rendezvous.
_STORE_CLOSED = ("Failed to recv", "Connection reset by peer", "Broken pipe", "Connection closed")


class StoreClosed(RuntimeError):
    """The job's store closed while this rank met the others: its host (rank 0) has ended,
    and says why itself; a launched worker ends quietly on it (``launch.peer_gone``)."""

    peer_gone = True


def _refusals(key: tuple[str, int, int, int], where: str) -> str | None:
    """What ranks that refused to join this rank's job wrote in its store (their different
    ``WORLD_SIZE``), read once this rank's wait in torch's rendezvous has ended; ``None``
    when none did, or the store no longer answers."""
    entry = _STORES.get(key)
    if entry is None:
        return None
    store, rank, world_size = entry[0], key[2], key[3]
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"dataparallel/attempt-{attempt}/refused"
    try:
        count = store.add(prefix, 0)
        found = [store.get(f"{prefix}/{n}").decode() for n in range(1, count + 1)]
    except Exception:  # the store's host has ended too: nothing to read
        return None
    if not found:
        return None
    return (
        f"environment variable WORLD_SIZE: rank {rank} has WORLD_SIZE={world_size}, and "
        f"{', '.join(found)} (they reached the job's store at MASTER_ADDR:MASTER_PORT={where} "
        f"and left): expected the same WORLD_SIZE on every rank; start every rank with the "
        f"same WORLD_SIZE (torchrun sets it from --nnodes and --nproc-per-node)"
    )
