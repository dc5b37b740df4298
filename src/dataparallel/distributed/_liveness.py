"""Which ranks still answer: a heartbeat per rank in the job's store, read when a collective
times out.

A gloo collective gives up at the group's limit with "Timed out waiting 5000ms for recv",
which names neither the endpoint nor the rank that stopped, and the launcher then blames the
rank that gave up. So every rank of a group that :func:`init_distributed` makes counts beats in
the job's store, from a daemon thread with a connection of its own (one ``add`` every
:data:`PERIOD_S`). When a collective times out, :func:`collective_timeout` reads every rank's
count twice, a few beats apart:

- a rank whose count stands still has stopped answering (``kill -STOP``, a debugger, swapped
  out, hung in C code with the GIL held), and is named, with its pid and host;
- if every count moves, every process is alive: one is slower than the limit, or runs another
  collective;
- if the store itself no longer answers, its host has stopped (rank 0, or torchrun's agent).
"""

from __future__ import annotations

import atexit
import datetime
import os
import select
import socket
import threading
import time

import torch.distributed as dist

__all__ = ["PERIOD_S", "CollectiveTimeout", "collective_timeout", "start", "stop"]

#: Seconds between two beats of a rank.
PERIOD_S = 0.5

#: How long the reader watches the counts: a rank that answers beats several times in it.
_WATCH_S = 4 * PERIOD_S

#: How long a connection to the store waits for an answer (the beat, and the reader's).
_STORE_TIMEOUT = datetime.timedelta(seconds=5)


class CollectiveTimeout(TimeoutError):
    """A collective waited past the group's limit; ``stopped`` are the ranks that stopped
    answering (``None``: the store no longer answers either, so it is not known)."""

    def __init__(
        self,
        message: str,
        rank: int,
        stopped: list[int] | None,
        first: bool = True,
        ended: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.stopped = stopped
        self.first = first
        self.ended = ended

    @property
    def speaks(self) -> bool:
        """Whether this rank is the one to say it, so that a job's ranks that all gave up say
        it once: the lowest rank still answering where some stopped; where every rank still
        answers, the first to give up (counted in the job's store); where the store's host
        has ended, none (that process, or its launcher, says why); where torchrun's agent
        hosts a store that no longer answers, every rank that gave up (nothing is left to
        agree through; where rank 0 hosts it, rank 0 is the one stopped)."""
        if self.ended:
            return False
        if self.stopped is None:
            return True
        if not self.stopped:
            return self.first
        return self.rank == min(r for r in range(self.rank + 1) if r not in self.stopped)


class _Heartbeat:
    """This rank's beats, and where to read everyone's."""

    def __init__(
        self, addr: str, port: int, rank: int, world_size: int, prefix: str, limit: float
    ) -> None:
        self.addr, self.port, self.rank, self.world_size = addr, port, rank, world_size
        self.prefix, self.limit = prefix, limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dataparallel-heartbeat")
        self._thread.daemon = True
        self._thread.start()

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore(
            self.addr,
            self.port,
            self.world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=self.wait),
            wait_for_workers=False,
        )

    @property
    def wait(self) -> float:
        """How long one exchange with the store may take: the job's limit, at most
        :data:`_STORE_TIMEOUT`."""
        return min(self.limit, _STORE_TIMEOUT.total_seconds())

    def _beat(self) -> None:
        watch = None
        try:
            store = self._client()
            store.set(
                f"{self.prefix}/who/rank-{self.rank}", f"{os.getpid()}@{socket.gethostname()}"
            )
            watch = _host_watch(self.addr, self.port, self.wait)
            while not self._stop.is_set() and not _closed(watch):
                store.add(f"{self.prefix}/beat/rank-{self.rank}", 1)
                if self._stop.wait(PERIOD_S):
                    return
        except Exception:  # the store is gone (its host ended): nothing left to beat into
            return
        finally:
            if watch is not None:
                watch.close()

    def stop(self, seconds: float | None = None) -> None:
        """Stop beating; wait for the thread at most ``seconds`` (by default one beat and one
        exchange with the store): a beat blocked on a stopped store is left behind."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(PERIOD_S + self.wait + 1.0 if seconds is None else seconds)

    def stopped_ranks(self) -> tuple[list[int], dict[int, str], bool] | str | None:
        """The ranks whose beats stood still while watched, who each of them is, and whether
        this rank is the first of the job to look; :data:`_ENDED` when nothing listens at the
        store's address any more (its host has ended), ``None`` when the store no longer
        answers.

        Every wait is bounded: torch's client applies its timeout to each request but not to
        the connect, which a stopped store host (``SIGSTOP``: the kernel still accepts the
        connection, nobody answers) holds forever. So the store is read from a daemon thread,
        given :attr:`wait` for its first answer and the watch plus :attr:`wait` for the rest,
        and left behind past those, as a store that no longer answers.
        """
        first, done = threading.Event(), threading.Event()
        found: list[tuple[list[int], dict[int, str], bool] | str] = []

        def read() -> None:
            try:
                # Asked first without torch, whose client, refused, retries until its timeout
                # and logs each try with C++ frames.
                socket.create_connection((self.addr, self.port), timeout=self.wait).close()
            except ConnectionRefusedError:
                found.append(_ENDED)
            except OSError:
                pass
            try:
                if found:
                    return
                store = self._client()
                keys = [f"{self.prefix}/beat/rank-{r}" for r in range(self.world_size)]
                told = store.add(f"{self.prefix}/gave-up", 1) == 1  # the first to look
                before = [store.add(key, 0) for key in keys]
                first.set()
                time.sleep(_WATCH_S)
                after = [store.add(key, 0) for key in keys]
                stopped = [r for r in range(self.world_size) if after[r] == before[r]]
                names = {r: f"{self.prefix}/who/rank-{r}" for r in stopped}
                who = {r: store.get(k).decode() for r, k in names.items() if store.check([k])}
                found.append(([r for r in stopped if r != self.rank], who, told))
            except Exception:  # the store's host answers no more
                pass
            finally:
                first.set()
                done.set()

        reader = threading.Thread(target=read, name="dataparallel-liveness", daemon=True)
        reader.start()
        if not first.wait(self.wait + 1.0) or not done.wait(_WATCH_S + self.wait + 1.0):
            return None
        return found[0] if found else None


def _host_watch(addr: str, port: int, seconds: float) -> socket.socket | None:
    """A connection to the store that sends nothing, kept to learn when the store's host has
    ended (it then reads as closed), or ``None`` where none can be made.

    A beat sent to a store whose host has ended (rank 0 gone after its error, while this rank
    still runs) fails inside torch's client, which logs it on stderr with a dozen lines of C++
    frames before raising; the heartbeat reads this connection before each beat and stops
    quietly instead.
    """
    try:
        return socket.create_connection((addr, port), timeout=seconds)
    except OSError:
        return None


def _closed(watch: socket.socket | None) -> bool:
    """Whether the store's end of ``watch`` has closed (its host ended)."""
    if watch is None:
        return False
    try:
        readable, _, _ = select.select([watch], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)  # a store never writes to a client that asked nothing: EOF


#: What :meth:`_Heartbeat.stopped_ranks` finds where the store's host has ended.
_ENDED = "ended"

_CURRENT: list[_Heartbeat] = []


def start(addr: str, port: int, rank: int, world_size: int, prefix: str, limit: float) -> None:
    """Beat for this rank in the store at ``addr:port`` under ``prefix``, until :func:`stop`
    or the interpreter's exit, whichever comes first."""
    stop()
    if world_size > 1:
        if not _AT_EXIT:
            atexit.register(stop)
            _AT_EXIT.append(True)
        _CURRENT.append(_Heartbeat(addr, port, rank, world_size, prefix, limit))


# Whether stop() runs at the interpreter's exit. A script may end without
# destroy_distributed: the heartbeat's daemon thread, left running, came back from the store's
# add (C++) while the interpreter finalised, and the forced unwind of that thread through C++
# aborted the process ("terminate called without an active exception", exit 134). atexit
# runs before finalisation: the thread is stopped and joined there (one beat at most), so it
# never outlives the interpreter, and, a daemon, it never keeps the process alive.
_AT_EXIT: list[bool] = []


def stop() -> None:
    """Stop this rank's beats (the group is being destroyed)."""
    while _CURRENT:
        _CURRENT.pop().stop()


_TIMED_OUT = ("Timed out waiting", "timed out", "Timeout")
_FIX = (
    "or wait longer with init_distributed(timeout=seconds), ddp_session(model, "
    "timeout=seconds) or DATAPARALLEL_DIST_TIMEOUT=seconds"
)


def collective_timeout(exc: BaseException) -> CollectiveTimeout | None:
    """Our error for ``exc`` when it is a collective of this rank's group that waited past the
    group's limit (gloo's "Timed out waiting ...ms"), naming the ranks that stopped answering;
    ``None`` for any other exception, or where no heartbeat runs."""
    kinds: tuple[type[BaseException], ...] = (RuntimeError,)
    if hasattr(dist, "DistError"):
        kinds = (RuntimeError, dist.DistError)
    if isinstance(exc, TimeoutError) or not isinstance(exc, kinds) or not _CURRENT:
        return None
    if not any(text in str(exc) for text in _TIMED_OUT):
        return None
    beat = _CURRENT[-1]
    where = f"{beat.addr}:{beat.port}"
    head = (
        f"rank {beat.rank} of {beat.world_size}: a collective waited {beat.limit:g} s, the "
        f"group's limit, and gave up"
    )
    found = beat.stopped_ranks()
    hosts = (
        "torchrun's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    )
    if isinstance(found, str):
        return CollectiveTimeout(
            f"{head}: the job's store at MASTER_ADDR:MASTER_PORT={where} has closed, so "
            f"{hosts}, which hosts it, has ended (its own error, or its launcher, says why); "
            f"expected every rank to reach the same collective within the limit; see why it "
            f"ended",
            beat.rank,
            None,
            ended=True,
        )
    if found is None:
        return CollectiveTimeout(
            f"{head}: the job's store at MASTER_ADDR:MASTER_PORT={where} no longer answers "
            f"either, so {hosts}, which hosts it, has stopped answering; expected every rank "
            f"to reach the same collective within the limit; see why it stopped, {_FIX}",
            beat.rank,
            # Rank 0 hosts it: rank 0 has stopped, and the lowest rank after it says so.
            None if hosts != "rank 0" else [0],
        )
    stopped, who, told = found
    if stopped:
        names = ", ".join(
            f"rank {r} (pid {who[r].replace('@', ' on host ', 1)})"
            if "@" in who.get(r, "")
            else f"rank {r}"
            for r in stopped
        )
        verb = "has" if len(stopped) == 1 else "have"
        return CollectiveTimeout(
            f"{head}: {names} {verb} stopped answering (no heartbeat in the job's store at "
            f"MASTER_ADDR:MASTER_PORT={where} for {_WATCH_S:g} s); expected every rank to reach "
            f"the same collective within the limit; see why that process stopped (stopped by "
            f"a signal or a debugger, swapped out, or hung inside C code), {_FIX}",
            beat.rank,
            stopped,
        )
    return CollectiveTimeout(
        f"{head}: every rank still answers (their heartbeats in the job's store at "
        f"MASTER_ADDR:MASTER_PORT={where} move), so one is slower than the limit or runs a "
        f"different collective; expected every rank to run the same collectives in the same "
        f"order, each within the limit; {_FIX.removeprefix('or ')}",
        beat.rank,
        [],
        told,
    )
