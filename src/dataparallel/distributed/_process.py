"""This process's place in a torchrun job, and the process group's life: setup and teardown.

:func:`init_distributed` reads torchrun's variables (:data:`ENV_VARS`) and starts the default
process group, or describes a single process when there are none; :func:`destroy_distributed`
tears the group down without gloo's shutdown deadlock; :func:`ddp_session` does both around a
``DistributedDataParallel`` module. :func:`rank_and_size` and :func:`local_device` answer "which
rank of how many, on which device" for the batch helpers (``_shard``, ``_gather_all``,
``_sampler``), from the process group, else torchrun's variables, else one process.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dataparallel.distributed import _liveness
from dataparallel.distributed._rendezvous import (
    gloo_on_loopback,
    init_process_group,
    resolve_timeout,
)

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "ENV_VARS",
    "DistInfo",
    "ddp_session",
    "destroy_distributed",
    "init_distributed",
    "local_device",
    "rank_and_size",
]

#: The variables torchrun sets for every worker; all or none of them must be present.
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_LAUNCH_HINT = (
    "launch the script with `torchrun --nproc-per-node N script.py` (or "
    "`dataparallel train --strategy ddp`), or unset all of them to run as a single process"
)


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """This process's place in the job.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank on this machine (the CUDA index under nccl).
        world_size: number of processes in the job.
        device: the device this process computes on.
        backend: ``"nccl"`` or ``"gloo"`` (or whatever an existing group uses); ``None`` when
            running as a single process without a process group.

    A record ``init_distributed`` and ``ddp_session`` return, not one to build.

    Example:
        >>> import dataparallel as dp
        >>> info = dp.init_distributed()  # no torchrun variables: one process, no group
        >>> info.rank, info.local_rank, info.world_size, info.backend
        (0, 0, 1, None)
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that should log and save checkpoints."""
        return self.rank == 0


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}: expected an integer, got {raw!r}; {_LAUNCH_HINT}"
        ) from None


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _backend_device(backend: str | None, local_rank: int) -> torch.device:
    """nccl computes on CUDA device ``local_rank``; gloo (and friends) on the CPU."""
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        index = local_rank if backend == "nccl" else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(
    *, backend: str | None = None, timeout: float | datetime.timedelta | None = None
) -> DistInfo:
    """Join the job torchrun started, or run as a single process when there is none.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. With all
    of them set, it initialises the default process group (once; a second call, or a group that
    already exists, is reused) with nccl when CUDA is available, after
    ``torch.cuda.set_device(local_rank)``, and gloo otherwise. With none of them set it starts no
    process group and describes a single process: rank 0 of 1, ``backend=None``; :func:`shard`,
    :func:`gather_all` and :class:`ShardedSampler` work unchanged then, and :func:`ddp_session`
    makes a private one-process group for DDP.

    ``MASTER_ADDR`` must resolve and ``MASTER_PORT`` be a port number (checked first, with our
    own message), and nothing waits without a limit: meeting the other ranks, and later every
    collective of the group, gives up after ``timeout`` (5 minutes by default, where torch
    waits 30) with a ``TimeoutError`` that says which endpoint was awaited and how to fix it.

    Args:
        backend: force a backend (e.g. ``"gloo"`` on a GPU machine); ``None`` picks as above.
        timeout: the limit, in seconds or as a ``timedelta``, on meeting the other ranks and on
            each collective; ``None`` reads ``DATAPARALLEL_DIST_TIMEOUT`` (seconds), else 300.

    Returns:
        A frozen :class:`DistInfo`.

    Raises:
        RuntimeError: only some of the variables are set (the message names the missing ones),
            or rank 0 cannot listen on ``MASTER_PORT`` (another program holds it).
        ValueError: a variable is not an integer, ranks are out of range, ``MASTER_PORT`` is
            not a port number, ``MASTER_ADDR`` does not resolve, or ``timeout`` is not positive.
        TimeoutError: the other ranks did not all arrive within ``timeout``.

    Example:
        >>> import dataparallel as dp
        >>> info = dp.init_distributed()  # run by plain python: rank 0 of 1, no group
        >>> info.rank, info.world_size, info.backend
        (0, 1, None)
        >>> dp.destroy_distributed()  # (a no-op here; under torchrun, at the end of the job)
    """
    if dist.is_available() and dist.is_initialized():
        used = dist.get_backend()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return DistInfo(
            dist.get_rank(),
            local_rank,
            dist.get_world_size(),
            _backend_device(used, local_rank),
            used,
        )
    limit = resolve_timeout(timeout)  # checked even for one process: a typo fails everywhere
    present = [name for name in ENV_VARS if name in os.environ]
    if not present:
        return DistInfo(0, 0, 1, _backend_device(backend, 0), None)
    missing = [name for name in ENV_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"incomplete torch.distributed environment: expected all of {list(ENV_VARS)}, "
            f"found {present} but not {missing}; {_LAUNCH_HINT}"
        )
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(
            f"environment: expected WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0, "
            f"got RANK={rank!r}, WORLD_SIZE={world_size!r}, LOCAL_RANK={local_rank!r}; "
            f"{_LAUNCH_HINT}"
        )
    chosen = backend or _default_backend()
    device = _backend_device(chosen, local_rank)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                f"visible; start at most that many processes per node (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
    init_process_group(chosen, rank, world_size, limit)
    return DistInfo(rank, local_rank, world_size, device, chosen)


def destroy_distributed(*, barrier: bool = True) -> None:
    """Tear down the default process group, if any, without the shutdown deadlock.

    gloo's worker threads release finished collectives (and the Python tensors in them) after
    the caller has seen them complete, which needs the GIL; torch joins those threads when the
    group is destroyed, so destroying it right after a collective, GIL held, can deadlock. This
    waits for the other ranks first (``barrier``), gives the worker threads a moment, then calls
    ``torch.distributed.destroy_process_group``. Use it in place of the latter.

    Args:
        barrier: wait for every rank first (on a normal exit); pass ``False`` after an error,
            when a peer may be gone.

    Raises:
        RuntimeError: the barrier failed (torch's ``DistBackendError``: a peer is gone) or
            passed the group's limit; the group is destroyed all the same.

    Example:
        >>> import torch.distributed as dist, dataparallel as dp
        >>> dp.destroy_distributed()  # no process group: nothing to tear down, no error
        >>> dist.is_initialized()
        False
    """
    _liveness.stop()
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        time.sleep(0.02)  # GIL released: the worker threads drop their finished work
        dist.destroy_process_group()


def _group_or_env(name: str, read: Callable[[], int], default: int) -> int:
    """The process group's value, else torchrun's variable ``name``, else ``default``.

    ``read`` is a lambda, not ``dist.get_rank`` itself: torch built without distributed support
    has no such attribute, and must still run as one process.
    """
    if dist.is_available() and dist.is_initialized():
        return read()
    if name in os.environ:
        return _env_int(name)
    return default


def rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else the process group's, else torchrun's variables, else 0 of 1."""
    if world_size is None:
        world_size = _group_or_env("WORLD_SIZE", lambda: dist.get_world_size(), 1)
    if rank is None:
        rank = _group_or_env("RANK", lambda: dist.get_rank(), 0)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size: expected at least 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank: expected 0 <= rank < world_size={world_size}, got {rank!r}; pass the rank "
            f"of this process, or leave it None to read it from the process group"
        )
    return rank, world_size


def local_device() -> torch.device:
    """This rank's device: CUDA under nccl (or single-process with CUDA), else the CPU."""
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return _backend_device(None, 0)


# --------------------------------------------------------------------------- DDP


@contextmanager
def ddp_session(
    module: torch.nn.Module,
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    **ddp_kwargs: Any,
) -> Iterator[tuple[DistributedDataParallel, DistInfo]]:
    """Run ``module`` under ``DistributedDataParallel`` for the length of a ``with`` block.

    Calls :func:`init_distributed`, moves ``module`` to this rank's device, wraps it in DDP
    (``device_ids=[local_rank]`` on CUDA, ``None`` on the CPU) and yields ``(ddp_module, info)``.
    On exit the process group is destroyed (:func:`destroy_distributed`: after a barrier on a
    normal exit, at once after an error), so a failed rank never leaves a group behind. A
    session inside another shares the outer one's group and leaves it up on exit: the outer
    session destroys it. Run as
    a single process (no torchrun variables), it makes a private one-process group, so the same
    script also runs with plain ``python``.

    DDP averages gradients over ranks, so a per-rank mean loss trains as the global mean only
    when the shards are equal; with uneven shards (e.g. from :func:`shard`) scale it:
    ``loss_sum_on_rank * world_size / global_batch_size``.

    Ranks that run different numbers of steps (uneven data) hang in DDP's all-reduce. Give
    every rank every step: a rank whose shard has run out steps on a batch of zero samples
    (its gradients are zeros), so all ranks all-reduce the same gradients and call
    ``optimizer.step()`` as one process does, and momentum, Adam's moments and schedulers stay
    equal on every rank. (torch's ``Join`` lets the finished rank skip its optimizer steps, so
    its optimizer state drifts.) ::

        counts = [len(ShardedSampler(data, rank=r)) for r in range(info.world_size)]
        steps = -(-max(counts) // batch)  # the most batches any rank has
        totals = [sum(min(batch, max(0, c - k * batch)) for c in counts) for k in range(steps)]
        empty = [t[:0] for t in next(iter(DataLoader(data, batch_size=1)))]
        batches = iter(loader)
        for k in range(steps):
            x, y = next(batches, empty)  # no batch left: zero samples
            loss = F.cross_entropy(ddp(x), y, reduction="sum") * info.world_size / totals[k]

    Args:
        module: the model; it is moved to this rank's device.
        backend: force a backend, as in :func:`init_distributed` (``"gloo"`` runs the ranks on
            the CPU of a GPU machine); ``None`` picks nccl with CUDA, else gloo.
        timeout: the limit on meeting the other ranks and on each collective, as in
            :func:`init_distributed` (default 300 s, or ``DATAPARALLEL_DIST_TIMEOUT``).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).

    Yields:
        ``(ddp_module, info)``: the module under DDP, and this process's :class:`DistInfo`.

    Raises:
        RuntimeError, ValueError, TimeoutError: as :func:`init_distributed` raises them; an
            error inside the block propagates after the group is destroyed.

    Example:
        >>> import torch, dataparallel as dp
        >>> with dp.ddp_session(torch.nn.Linear(3, 1), backend="gloo") as (ddp, info):
        ...     ddp(torch.randn(4, 3)).sum().backward()  # gradients all-reduced over ranks
        >>> info.world_size, info.backend  # plain python: a private one-process group
        (1, 'gloo')
    """
    if _OPEN_SESSIONS[0] and dist.is_available() and dist.is_initialized():
        # Inside another session: share its group, and leave its teardown to it.
        with _nested_session(module, ddp_kwargs) as shared:
            yield shared
        return
    _OPEN_SESSIONS[0] += 1
    try:
        with _own_session(module, backend, timeout, ddp_kwargs) as own:
            yield own
    finally:
        _OPEN_SESSIONS[0] -= 1


#: How many ``ddp_session`` blocks that own their group are open in this process (0 or 1).
_OPEN_SESSIONS = [0]


@contextmanager
def _nested_session(
    module: torch.nn.Module, ddp_kwargs: dict[str, Any]
) -> Iterator[tuple[DistributedDataParallel, DistInfo]]:
    """A session inside another: DDP over the outer session's group, which stays up after it
    (destroying it, as a session of its own does, left the outer one gathering alone)."""
    from torch.nn.parallel import DistributedDataParallel

    info = init_distributed()  # the outer session's group, as it is
    module.to(info.device)
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    try:
        yield DistributedDataParallel(module, device_ids=device_ids, **ddp_kwargs), info
    except BaseException as exc:
        timed_out = _liveness.collective_timeout(exc)
        if timed_out is not None:
            raise timed_out from None
        raise


@contextmanager
def _own_session(
    module: torch.nn.Module,
    backend: str | None,
    timeout: float | datetime.timedelta | None,
    ddp_kwargs: dict[str, Any],
) -> Iterator[tuple[DistributedDataParallel, DistInfo]]:
    """A session that owns its group: made (or taken from ``init_distributed``) here, and
    destroyed on the way out, whatever happened."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        info = init_distributed(backend=backend, timeout=timeout)
        if info.backend is None:
            chosen = backend or _default_backend()
            # one process: nothing to reach from outside
            with gloo_on_loopback("127.0.0.1") if "gloo" in chosen else nullcontext():
                dist.init_process_group(
                    chosen,
                    store=dist.HashStore(),
                    rank=0,
                    world_size=1,
                    timeout=resolve_timeout(timeout),
                )
            info = dataclasses.replace(info, backend=chosen)
        module.to(info.device)
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **ddp_kwargs)
        yield ddp, info
    except BaseException as exc:
        # A collective past the limit: which rank stopped answering is read before the group
        # (and this rank's heartbeat) goes.
        timed_out = _liveness.collective_timeout(exc)
        destroy_distributed(barrier=False)  # a peer may be gone: no barrier
        if timed_out is not None:
            raise timed_out from None
        raise
    destroy_distributed()
