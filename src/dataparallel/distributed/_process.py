"""The same batch rules past one machine: torch.distributed, DDP and torchrun.

One process per device, launched by ``torchrun`` (or ``dataparallel train --strategy ddp``):

- :func:`init_distributed` reads torchrun's environment and starts the process group;
- :func:`shard` gives this rank its part of a global batch under the rules of ``dp.scatter``;
- :func:`gather_all` gives every rank everyone's outputs, in rank order, under the rules of
  ``dp.gather``, with uneven sizes exact (nothing padded, nothing duplicated);
- :class:`ShardedSampler` partitions a dataset's indices exactly over the ranks;
- :func:`ddp_session` wraps a module in ``DistributedDataParallel`` and always tears the process
  group down.

Without torchrun's variables everything runs as one process (world size 1, rank 0), so the same
script runs with ``python train.py`` and with ``torchrun --nproc-per-node 4 train.py``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from dataparallel._common.describe import describe
from dataparallel._common.tree import contains_array, leaves
from dataparallel.devices import DeviceSpec, resolve_device
from dataparallel.gather import first_batch_size, gather

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from dataparallel.gather import ScalarMode

__all__ = [
    "ENV_VARS",
    "DistInfo",
    "ShardedSampler",
    "ddp_session",
    "destroy_distributed",
    "gather_all",
    "init_distributed",
    "shard",
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


def init_distributed(*, backend: str | None = None) -> DistInfo:
    """Join the job torchrun started, or run as a single process when there is none.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. With all
    of them set, it initialises the default process group (once; a second call, or a group that
    already exists, is reused) with nccl when CUDA is available, after
    ``torch.cuda.set_device(local_rank)``, and gloo otherwise. With none of them set it starts no
    process group and describes a single process: rank 0 of 1, ``backend=None``; :func:`shard`,
    :func:`gather_all` and :class:`ShardedSampler` work unchanged then, and :func:`ddp_session`
    makes a private one-process group for DDP.

    Args:
        backend: force a backend (e.g. ``"gloo"`` on a GPU machine); ``None`` picks as above.

    Returns:
        A frozen :class:`DistInfo`.

    Raises:
        RuntimeError: only some of the variables are set (the message names the missing ones).
        ValueError: a variable is not an integer, or ranks are out of range.
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
    present = [name for name in ENV_VARS if name in os.environ]
    if not present:
        return DistInfo(0, 0, 1, _backend_device(None, 0), None)
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
    dist.init_process_group(chosen, init_method="env://", rank=rank, world_size=world_size)
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
    """
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


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
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


def _local_device() -> torch.device:
    """This rank's device: CUDA under nccl (or single-process with CUDA), else the CPU."""
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return _backend_device(None, 0)


def shard(
    batch: Any,
    rank: int | None = None,
    world_size: int | None = None,
    dim: int = 0,
    *,
    device: DeviceSpec | None = None,
    **opts: Any,
) -> Any:
    """This rank's part of a global batch, under the batch rules of ``dp.scatter``.

    Every rank calls it with the same global batch; rank ``r`` gets the ``r``-th chunk of the
    plan over ``world_size`` copies of its device, so the chunks over all ranks are the batch,
    in order, with nothing dropped or duplicated. When the batch has fewer samples than ranks,
    the ranks past the used ones get an empty slice (empty tensors and lists, broadcast inputs
    unchanged), so every rank still runs the same collectives.

    Args:
        batch: the global batch; a ``tuple`` is an argument tuple (a tuple comes back), anything
            else one argument (its chunk comes back), as in ``dp.scatter``.
        rank: this rank; ``None`` reads the process group (or ``RANK``, else 0).
        world_size: number of ranks; ``None`` reads the process group (or ``WORLD_SIZE``, else 1).
        dim: the batch dimension of tensors.
        device: where this rank's chunk goes; ``None`` is this rank's device (CUDA under nccl,
            else the CPU).
        **opts: ``batch_size``, ``chunk_sizes`` and ``weights`` (one per rank), ``max_size``,
            ``dtype``, ``strict``, as in ``dp.scatter``.

    Returns:
        This rank's chunk, or a tuple of chunks when ``batch`` is a tuple.

    >>> import torch
    >>> shard(torch.arange(5), rank=1, world_size=2, device="cpu")
    tensor([3, 4])
    """
    from dataparallel.plan import build_plan, check_options
    from dataparallel.scatter import take

    check_options(opts)
    rank, world_size = _rank_and_size(rank, world_size)
    here = _local_device() if device is None else resolve_device(device, where="device")
    # one "device" per rank; a batch that needs waves under max_size is an error, as in scatter
    planned = build_plan(batch, None, [here] * world_size, dim, allow_waves=False, **opts)
    for message in planned.warnings:
        warnings.warn(message, UserWarning, stacklevel=2)
    sizes = planned.device_sizes[0]  # one per rank, 0 for a rank past the batch
    start = sum(sizes[:rank])
    args, _kwargs = take(planned, start, sizes[rank], here)
    return args


# --------------------------------------------------------------------------- gather_all


def _identity(obj: Any) -> Any:
    return obj


def _is_compact_cpu(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and not t.requires_grad
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


class _CpuPickler(pickle.Pickler):
    """Pickles tensors as detached, compact CPU copies (a view never ships its whole storage)."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            isinstance(obj, torch.Tensor)
            and obj.layout == torch.strided
            and not _is_compact_cpu(obj)
        ):
            return _identity, (obj.detach().to("cpu").clone(),)
        return NotImplemented


def _to_cpu_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CpuPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _first_list_length(obj: Any) -> int | None:
    """The length of the first list inside ``obj``, depth first."""
    return next((len(o) for o in leaves(obj, is_leaf=_is_list) if _is_list(o)), None)


def _is_list(obj: Any) -> bool:
    return isinstance(obj, list)


def _local_batch_size(obj: Any, dim: int) -> int | None:
    """This rank's chunk size: the first batched tensor or ndarray, else (when there is no
    tensor at all, e.g. a list of predicted labels) the length of the first list."""
    found = first_batch_size(obj, dim)
    if found is None and not contains_array(obj):
        found = _first_list_length(obj)
    return found


def gather_all(
    obj: Any,
    dim: int = 0,
    *,
    scalars: ScalarMode = "mean",
    batch_size: int | None = None,
    device: DeviceSpec | None = None,
) -> Any:
    """Every rank's ``obj``, gathered in rank order under the rules of ``dp.gather``, on every rank.

    Each rank's chunk size is exchanged with its outputs, so uneven sizes come back exact: a
    batch sharded by :func:`shard` (or a dataset by :class:`ShardedSampler`) and gathered here is
    the global batch, in order, with nothing padded and nothing repeated. Tensors, ndarrays,
    per-sample lists of strings or of variable-size tensors, dicts, dataclasses and scalars all
    follow the gather rules (a mean-reduced loss comes back as the global mean). With
    ``scalars="mean"``, ranks whose part is empty (a batch smaller than the world) are left out,
    so their ``nan`` losses do not spoil the mean.

    Objects travel as pickled CPU copies (``all_gather_object``); tensors come back on this
    rank's device. Gradients flow only into this rank's own part (the other ranks' parts are
    copies), so use it for evaluation and logging, and DDP for training.

    Every rank must call it, the same number of times: gather once after an evaluation loop
    rather than per batch when ranks may see different numbers of batches.

    Args:
        obj: this rank's outputs, nested as ``dp.gather`` accepts.
        dim: the batch dimension of tensors.
        scalars: ``"mean"`` (weighted by chunk size), ``"sum"`` or ``"stack"``, as in ``dp.gather``.
        batch_size: this rank's chunk size; ``None`` reads it from the first tensor or ndarray
            with a batch dimension, or, when ``obj`` holds no tensor at all, from the length of
            its first list. Pass it when neither reading is right.
        device: where tensors land; ``None`` is this rank's device.

    Raises:
        ValueError: the ranks' outputs do not fit together (keys, lengths or types differ);
            the message lists every rank's structure and shapes.

    >>> import torch
    >>> gather_all({"pred": torch.tensor([1, 2]), "names": ["a", "b"]})  # one process
    {'pred': tensor([1, 2]), 'names': ['a', 'b']}
    """
    here = _local_device() if device is None else resolve_device(device, where="device")
    local_size = _local_batch_size(obj, dim) if batch_size is None else int(batch_size)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        exchanged: list[Any] = [None] * world_size
        dist.all_gather_object(exchanged, (local_size, _to_cpu_bytes(obj)))
        sizes = [entry[0] for entry in exchanged]
        outputs = [
            obj if r == rank else pickle.loads(payload)  # our own ranks' bytes
            for r, (_size, payload) in enumerate(exchanged)
        ]
    else:
        sizes, outputs = [local_size], [obj]
    chunk_sizes = None if any(size is None for size in sizes) else [int(s) for s in sizes]
    kept = list(range(len(outputs)))
    if scalars == "mean" and chunk_sizes is not None and sum(chunk_sizes) > 0:
        # A rank with an empty part (fewer samples than ranks) weighs nothing in a mean, and
        # its mean-reduced loss is nan: leave it out rather than let 0 * nan poison the mean.
        kept = [r for r, size in enumerate(chunk_sizes) if size > 0]
    try:
        return gather(
            [outputs[r] for r in kept],
            here,
            dim,
            chunk_sizes=None if chunk_sizes is None else [chunk_sizes[r] for r in kept],
            scalars=scalars,
        )
    except ValueError as exc:
        pictures = "\n".join(
            f"  rank {r} (batch {sizes[r]}): {describe(out, nested=True)}"
            for r, out in enumerate(outputs)
        )
        raise ValueError(
            f"gather_all: the ranks' outputs do not fit together: {exc}\nper rank:\n{pictures}\n"
            f"make every rank return the same structure (same keys, types and nesting)"
        ) from exc


# --------------------------------------------------------------------------- sampler


class ShardedSampler(Sampler[int]):
    """An exact partition of a dataset's indices over the ranks: every index exactly once.

    The indices (shuffled from ``seed + epoch`` when ``shuffle``) are cut into ``world_size``
    contiguous blocks, as even as possible with the larger blocks first, the same split
    :func:`shard` makes of a batch. Nothing is padded or dropped, so ranks may get one sample
    more or fewer; in rank order the blocks are the whole (shuffled) order, so
    :func:`gather_all` of per-sample outputs, gathered once after the loop, comes back in the
    dataset's order when ``shuffle=False``.

    With uneven blocks ranks may run different numbers of batches: for evaluation gather once
    at the end; for DDP training wrap the loop in ``torch.distributed.algorithms.Join`` (see
    :func:`ddp_session`), or use a batch size that divides every rank's count.

    Args:
        dataset: anything with ``len()``.
        shuffle: shuffle the indices each epoch (the same permutation on every rank).
        seed: the base seed; every rank must use the same one.
        rank: this rank; ``None`` reads the process group (or ``RANK``, else 0).
        world_size: number of ranks; ``None`` reads the process group (or ``WORLD_SIZE``, else 1).

    >>> list(ShardedSampler(range(5), shuffle=False, rank=0, world_size=2))
    [0, 1, 2]
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                f"dataset: expected an object with len(), got {type(dataset).__name__}; "
                f"an IterableDataset must be split by the dataset itself"
            )
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``seed + epoch`` from now on (call it before each epoch)."""
        self.epoch = int(epoch)

    def _bounds(self) -> tuple[int, int]:
        total = len(self.dataset)
        base, extra = divmod(total, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch, in the order they are yielded."""
        start, stop = self._bounds()
        if not self.shuffle:
            return list(range(start, stop))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)
        return order[start:stop].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        start, stop = self._bounds()
        return stop - start


# --------------------------------------------------------------------------- DDP


@contextmanager
def ddp_session(
    module: torch.nn.Module, **ddp_kwargs: Any
) -> Iterator[tuple[DistributedDataParallel, DistInfo]]:
    """Run ``module`` under ``DistributedDataParallel`` for the length of a ``with`` block.

    Calls :func:`init_distributed`, moves ``module`` to this rank's device, wraps it in DDP
    (``device_ids=[local_rank]`` on CUDA, ``None`` on the CPU) and yields ``(ddp_module, info)``.
    On exit the process group is destroyed (:func:`destroy_distributed`: after a barrier on a
    normal exit, at once after an error), so a failed rank never leaves a group behind. Run as
    a single process (no torchrun variables), it makes a private one-process group, so the same
    script also runs with plain ``python``.

    DDP averages gradients over ranks, so a per-rank mean loss trains as the global mean only
    when the shards are equal; with uneven shards (e.g. from :func:`shard`) scale it:
    ``loss_sum_on_rank * world_size / global_batch_size``.

    Ranks that run different numbers of steps (uneven data) hang in DDP's all-reduce. Use
    torch's ``Join``::

        from torch.distributed.algorithms.join import Join

        with ddp_session(model) as (ddp, info), Join([ddp]):
            for x, y in loader:  # may have fewer batches on some ranks
                ...

    Args:
        module: the model; it is moved to this rank's device.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).

    Yields:
        ``(ddp_module, info)``.
    """
    from torch.nn.parallel import DistributedDataParallel

    try:
        info = init_distributed()
        if info.backend is None:
            backend = _default_backend()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            info = dataclasses.replace(info, backend=backend)
        module.to(info.device)
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **ddp_kwargs)
        yield ddp, info
    except BaseException:
        destroy_distributed(barrier=False)  # a peer may be gone: no barrier
        raise
    destroy_distributed()
