"""One rank's part of a global batch: ``dp.scatter``'s batch rules, cut by rank.

Every rank holds the same global batch and keeps only its chunk of the plan over ``world_size``
copies of its device, so no data moves between ranks; :func:`gather_all` (``_gather_all``) is
the way back.
"""

from __future__ import annotations

import warnings
from typing import Any

from dataparallel.devices import DeviceSpec, resolve_device
from dataparallel.distributed._process import local_device, rank_and_size

__all__ = ["shard"]


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

    Raises:
        TypeError: an unknown option.
        ValueError: ``rank`` or ``world_size`` out of range, a bad device spec or option, or a
            batch the rules cannot split (as ``dp.scatter`` raises them).

    Example:
        >>> import torch, dataparallel as dp
        >>> dp.shard(torch.arange(5), rank=1, world_size=2, device="cpu")
        tensor([3, 4])
    """
    from dataparallel.plan import build_plan, check_options
    from dataparallel.scatter import take

    check_options(opts)
    rank, world_size = rank_and_size(rank, world_size)
    here = local_device() if device is None else resolve_device(device, where="device")
    # one "device" per rank; a batch that needs waves under max_size is an error, as in scatter
    planned = build_plan(batch, None, [here] * world_size, dim, allow_waves=False, **opts)
    for message in planned.warnings:
        warnings.warn(message, UserWarning, stacklevel=2)
    sizes = planned.device_sizes[0]  # one per rank, 0 for a rank past the batch
    start = sum(sizes[:rank])
    args, _kwargs = take(planned, start, sizes[rank], here)
    return args
