"""Every rank's outputs on every rank, in rank order, under ``dp.gather``'s rules.

Each rank's outputs travel as pickled, compact CPU copies (``all_gather_object``) with its chunk
size, so uneven parts come back exact (nothing padded, nothing duplicated) and are gathered here
as ``dp.gather`` gathers the replicas' outputs.
"""

from __future__ import annotations

import dataclasses
import io
import numbers
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dataparallel._common.describe import describe
from dataparallel._common.tree import contains_array, leaves
from dataparallel.devices import DeviceSpec, resolve_device
from dataparallel.distributed._liveness import collective_timeout
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


def _paired_leaves(outputs: list[Any], path: str = "output") -> Iterator[tuple[str, list[Any]]]:
    """Every rank's value at each path, for paths whose containers agree on every rank (the
    gather itself reports those that do not): dicts, tuples, lists and dataclasses."""
    first = outputs[0]
    if isinstance(first, Mapping):
        if all(isinstance(o, Mapping) and list(o) == list(first) for o in outputs):
            for key in first:
                yield from _paired_leaves([o[key] for o in outputs], f"{path}[{key!r}]")
    elif isinstance(first, (list, tuple)):
        if all(isinstance(o, (list, tuple)) and len(o) == len(first) for o in outputs):
            for i in range(len(first)):
                yield from _paired_leaves([o[i] for o in outputs], f"{path}[{i}]")
    elif dataclasses.is_dataclass(first) and not isinstance(first, type):
        if all(type(o) is type(first) for o in outputs):
            for field in dataclasses.fields(first):
                values = [getattr(o, field.name) for o in outputs]
                yield from _paired_leaves(values, f"{path}.{field.name}")
    else:
        yield path, outputs


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_float_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.is_floating_point()
    return isinstance(value, float)


def _warn_unreadable_scalars(
    outputs: list[Any],
    sizes: Sequence[int] | None,
    scalars: str,
    rules: Mapping[str, Any] | None,
) -> None:
    """Warn where the gather rules give a result one process would not: Python ints equal on
    every rank (read as a constant, returned once, where an evaluation loop's counts should be
    summed) and, with the ranks' sizes unknown, float scalars that differ (an unweighted mean,
    ``nan`` from an empty rank). Both are silent under the in-process rules, where chunk sizes
    are always known and the replicas share one forward; across ranks they are the common case
    (``{"correct": 4, "total": 5}``, a loss gathered alone)."""
    if scalars != "mean" or len(outputs) < 2 or dist.get_rank() != 0:
        return  # every rank sees the same values: rank 0 alone says it
    for path, values in _paired_leaves(outputs):
        if rules and path in rules:
            continue
        if all(_is_int(v) for v in values) and all(v == values[0] for v in values):
            if sizes is not None and all(v == n for v, n in zip(values, sizes, strict=True)):
                continue  # each rank's chunk size: summed, as a count of samples
            warnings.warn(
                f"gather_all: {path} is the Python int {values[0]!r} on every one of the "
                f"{len(values)} ranks, so it is read as a constant and returned once (the "
                f"gather rule for an int equal on every replica); one process counting over "
                f"the whole data would give {sum(values)!r} if it is a count. If it is a count, "
                f"gather it as a tensor (torch.tensor(n): integer tensors are summed), or pass "
                f"output_rules={{{path!r}: 'sum'}} or scalars='sum'; if it is a constant, pass "
                f"output_rules={{{path!r}: 'same'}} to say so",
                UserWarning,
                stacklevel=3,
            )
        elif sizes is None and all(_is_float_scalar(v) for v in values):
            floats = [float(v) for v in values]
            if any(f != floats[0] for f in floats if f == f) or any(f != f for f in floats):
                warnings.warn(
                    f"gather_all: {path} is a float scalar whose ranks' sizes are unknown (no "
                    f"batched tensor and no list beside it), so its values {floats} are "
                    f"averaged unweighted, and an empty rank's nan spoils the mean; one process "
                    f"weighs each sample once. Pass batch_size=<this rank's sample count> to "
                    f"weigh each rank by its samples (empty ranks are left out), or "
                    f"scalars='sum' with per-rank sums",
                    UserWarning,
                    stacklevel=3,
                )


def gather_all(
    obj: Any,
    dim: int = 0,
    *,
    scalars: ScalarMode = "mean",
    batch_size: int | None = None,
    device: DeviceSpec | None = None,
    output_rules: Mapping[str, int | str] | None = None,
) -> Any:
    """Every rank's ``obj``, gathered in rank order under the rules of ``dp.gather``, on every rank.

    Each rank's chunk size is exchanged with its outputs, so uneven sizes come back exact: a
    batch sharded by :func:`shard` (or a dataset by :class:`ShardedSampler`) and gathered here is
    the global batch, in order, with nothing padded and nothing repeated. Tensors, ndarrays,
    per-sample lists of strings or of variable-size tensors, dicts, dataclasses and scalars all
    follow the gather rules (a mean-reduced loss comes back as the global mean). A rank whose
    part is empty (a batch smaller than the world) weighs nothing in a mean, so its ``nan``
    loss does not spoil it; its counts, lists and other outputs are gathered as any rank's.

    Objects travel as pickled CPU copies (``all_gather_object``); tensors come back on this
    rank's device. Gradients flow only into this rank's own part (the other ranks' parts are
    copies), so use it for evaluation and logging, and DDP for training.

    Every rank must call it, the same number of times: gather once after an evaluation loop
    rather than per batch when ranks may see different numbers of batches.

    Where the gather rules would give what one process would not, rank 0 warns (once per place),
    naming the path and the fix: a Python int equal on every rank is read as a constant and
    returned once (``{"correct": 4, "total": 5}`` gives 5, not 10): gather counts as tensors,
    or pass ``output_rules={"output['total']": "sum"}``; a float scalar with no batched value
    beside it (a loss gathered alone) is an unweighted mean over ranks: pass ``batch_size=``.

    Args:
        obj: this rank's outputs, nested as ``dp.gather`` accepts.
        dim: the batch dimension of tensors.
        scalars: ``"mean"`` (weighted by chunk size), ``"sum"`` or ``"stack"``, as in ``dp.gather``.
        batch_size: this rank's chunk size; ``None`` reads it from the first tensor or ndarray
            with a batch dimension, or, when ``obj`` holds no tensor at all, from the length of
            its first list. Pass it when neither reading is right.
        device: where tensors land; ``None`` is this rank's device.
        output_rules: ``{path: rule}`` as in ``dp.gather`` (``"sum"``, ``"mean"``, ``"same"``,
            ``"list"``, a batch dimension...), e.g. ``{"output['total']": "sum"}``.

    Returns:
        The ranks' outputs gathered into one, the same on every rank; without a process group,
        ``obj`` gathered as one rank's (its tensors on ``device``).

    Raises:
        ValueError: the ranks' outputs do not fit together (keys, lengths or types differ);
            the message lists every rank's structure and shapes.
        TimeoutError: the exchange waited past the group's limit; the message names the
            ranks that stopped answering, and the job's store.

    Example:
        >>> import torch, dataparallel as dp
        >>> out = {"pred": torch.tensor([1, 2]), "names": ["a", "b"]}
        >>> dp.gather_all(out, device="cpu")  # one process: its own outputs
        {'pred': tensor([1, 2]), 'names': ['a', 'b']}
    """
    here = local_device() if device is None else resolve_device(device, where="device")
    local_size = _local_batch_size(obj, dim) if batch_size is None else int(batch_size)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        exchanged: list[Any] = [None] * world_size
        try:
            dist.all_gather_object(exchanged, (local_size, _to_cpu_bytes(obj)))
        except RuntimeError as exc:  # (torch's DistError is one)
            timed_out = collective_timeout(exc)
            if timed_out is None:
                raise
            raise timed_out from None
        sizes = [entry[0] for entry in exchanged]
        outputs = [
            obj if r == rank else pickle.loads(payload)  # our own ranks' bytes
            for r, (_size, payload) in enumerate(exchanged)
        ]
    else:
        sizes, outputs = [local_size], [obj]
    chunk_sizes = None if any(size is None for size in sizes) else [int(s) for s in sizes]
    # A rank with an empty part (fewer samples than ranks) is gathered as any other: its
    # weight in a mean is 0, which the gather leaves out (its mean-reduced loss is nan, and
    # 0 * nan would poison the mean), while its counts, lists and objects count as one
    # process's would (issue 51: leaving the whole rank out lost them).
    _warn_unreadable_scalars(outputs, chunk_sizes, scalars, output_rules)
    try:
        return gather(
            outputs,
            here,
            dim,
            chunk_sizes=chunk_sizes,
            scalars=scalars,
            output_rules=output_rules,
        )
    except ValueError as exc:
        pictures = "\n".join(
            f"  rank {r} (batch {sizes[r]}): {describe(out, nested=True)}"
            for r, out in enumerate(outputs)
        )
        raise ValueError(
            f"gather_all: the ranks' outputs do not fit together: {_rank_words(str(exc))}\n"
            f"per rank:\n{pictures}\nmake every rank return the same structure (same keys, "
            f"types and nesting)"
        ) from exc


# dp.gather's advice that gather_all has no use for: it has no gather=False.
_NO_GATHER_FALSE = re.compile(
    r",? or use gather=False( to handle the per-replica outputs yourself)?"
)


def _rank_words(text: str) -> str:
    """``dp.gather``'s message about replicas, said of ranks: each replica's outputs here are a
    rank's, and its way out, ``gather=False``, is an option ``gather_all`` does not have."""
    text = _NO_GATHER_FALSE.sub("", text)
    text = text.replace("Make forward return", "Return")
    return re.sub(r"\breplica(s?)\b", r"rank\1", text)
