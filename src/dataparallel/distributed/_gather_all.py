"""Every rank's outputs on every rank, in rank order, under ``dp.gather``'s rules.

Each rank's outputs travel as pickled, compact CPU copies (``all_gather_object``) with its chunk
size, so uneven parts come back exact (nothing padded, nothing duplicated) and are gathered here
as ``dp.gather`` gathers the replicas' outputs.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dataparallel._common.describe import describe
from dataparallel._common.tree import contains_array, leaves
from dataparallel.devices import DeviceSpec, resolve_device
from dataparallel.distributed._process import local_device
from dataparallel.gather import first_batch_size, gather

if TYPE_CHECKING:
    from dataparallel.gather import ScalarMode

__all__ = ["gather_all"]


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
    here = local_device() if device is None else resolve_device(device, where="device")
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
