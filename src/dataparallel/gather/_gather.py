"""Gather: the replicas' outputs -> one output, in batch order, on the target device.

``torch.nn.DataParallel`` concatenates every tensor it finds, turns 0-dim losses into a vector
and fails on strings, dataclasses and lists of boxes. ``gather`` reads each output by what it
is, under the guide's gather rules (docs/guide.md): batched tensors are concatenated, losses
averaged by chunk size, per-sample lists joined, structures rebuilt with their own type, and
everything else kept once when the replicas agree.

The walk dispatches once per value on its class (cached), and builds argument paths such as
``output['attn']`` only when a message needs one. With one replica it is a plain walk that moves
tensors to the target device and rebuilds only containers whose contents moved.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn

from dataparallel._common.checks import (
    check_chunk_sizes_of,
    check_gather_sizes,
    check_scalar_weights,
    concat_error,
)
from dataparallel._common.packed import gather_packed, is_packed
from dataparallel._common.tree import (
    ARRAY,
    BOOL,
    DATACLASS,
    LIST,
    MAPPING,
    NAMEDTUPLE,
    NONE,
    NUMBER,
    OTHER,
    RECORD,
    SHAPE,
    STRUCTURES,
    TENSOR,
    TUPLE,
    Kind,
    TooDeep,
    fields_of,
    item_types,
    kind_of,
    leaves,
    rebuild_mapping,
    rebuild_record,
    rebuild_sequence,
)
from dataparallel._common.warn import warn_user
from dataparallel.devices import DeviceSpec
from dataparallel.devices import target_device as resolve_target
from dataparallel.gather._output_rules import (
    apply_rule,
    check_output_rules,
    hidden_state,
    note_roles,
    rnn_state_shapes,
    warn_unmatched,
)
from dataparallel.gather._outputs import (
    ATOMS,
    all_equal,
    arrays_equal,
    fmt,
    rebuild_at,
    to_target,
)
from dataparallel.gather._scalars import gather_scalars

__all__ = ["ScalarMode", "check_scalars", "first_batch_size", "gather", "gather_outputs"]

ScalarMode = Literal["mean", "sum", "stack"]
_SHAPE = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")  # True for CPU tensors only (not meta, not CUDA)
_CPU = torch.device("cpu")  # equal only to device(type='cpu'), not to 'cpu:0'
_SCALAR_MODES = ("mean", "sum", "stack")

# A path is a chain of (parent, accessor, key) tuples, None at the root; it is formatted only
# for a message, so the walk pays nothing for it.
_Path = Any
_Ctx = Any  # a _Context; Any keeps the handler table simple to type


class _Context:
    """What every step of one gather needs; built once per call."""

    __slots__ = (
        "counts",
        "dim",
        "module",
        "origins",
        "roles",
        "rules",
        "scalars",
        "seen",
        "sizes",
        "states",
        "target",
        "total",
        "weights",
    )

    def __init__(
        self,
        target: torch.device,
        dim: int,
        sizes: tuple[int, ...] | None,
        scalars: str,
        n: int,
        scalar_weights: tuple[float, ...] | None = None,
    ) -> None:
        self.target = target
        self.dim = dim
        self.sizes = sizes
        self.scalars = scalars
        # Unknown sizes (or all zero) weigh every replica alike.
        self.counts: tuple[float, ...] = sizes if sizes is not None and sum(sizes) > 0 else (1,) * n
        if scalar_weights is not None and sum(scalar_weights) > 0:
            self.counts = scalar_weights  # e.g. each chunk's count of labelled tokens
        self.total = sum(self.counts)
        self.weights = tuple(c / self.total for c in self.counts)
        self.rules: dict[str, int | str] | None = None  # output_rules, by formatted path
        self.seen: list[str] = []  # the paths walked, when rules are given (for a typo)
        self.module: nn.Module | None = None
        self.origins: Any = None  # a _origins.Origins: which scalars each replica received
        # Paths where an RNN layer puts its output ("sequence") and state ("state"): the items
        # of a pair (tensor, state), state a tensor or a pair (h_n, c_n). Made on first need.
        self.roles: dict[Any, str] | None = None
        self.states: frozenset[tuple[int, int]] | None = None  # read from module when needed

    def state_shapes(self) -> frozenset[tuple[int, int]]:
        """The module's RNN hidden-state shapes, read once per gather, on first need."""
        if self.states is None:
            self.states = rnn_state_shapes(self.module)
        return self.states


def check_scalars(scalars: str) -> ScalarMode:
    """``scalars`` as a ``ScalarMode``, or a ValueError that says which to use when."""
    if scalars not in _SCALAR_MODES:
        raise ValueError(
            f"scalars: expected one of {_SCALAR_MODES!r}, got {scalars!r}; use 'mean' for "
            f"mean-reduced losses, 'sum' for sums and counts, 'stack' for torch's vector"
        )
    return cast(ScalarMode, scalars)


def gather(
    outputs: Sequence[Any],
    target_device: DeviceSpec | None,
    dim: int = 0,
    *,
    chunk_sizes: Sequence[int] | None = None,
    scalars: ScalarMode = "mean",
    scalar_weights: Sequence[float] | None = None,
    output_rules: Mapping[str, int | str] | None = None,
    module: nn.Module | None = None,
) -> Any:
    """Gather one output per replica into one output, batch order restored.

    Args:
        outputs: one output per replica, in batch order.
        target_device: where the result lands; ``-1`` and ``"cpu"`` mean the CPU.
        dim: the batch dimension of tensors and ndarrays.
        chunk_sizes: each replica's chunk size (the plan's). ``None`` reads each replica's
            size from its first tensor or ndarray (depth first) with a batch dimension; where
            a replica has none, sizes are unknown: nothing is treated as batched by size,
            means are unweighted, and the replicas' lists are joined in replica order (as
            accelerate's ``gather_object`` does; lists of 0-dim tensors stay structure).
        scalars: ``"mean"`` (chunk-weighted; constants come back unchanged), ``"sum"`` or
            ``"stack"`` (torch's 1-d tensor) for numeric scalars such as losses.
        scalar_weights: one weight per replica for ``scalars="mean"`` in place of the chunk
            sizes, e.g. each chunk's number of labelled tokens, so that per-chunk token means
            combine into the global token mean. A replica of weight 0 is left out of the mean
            (its loss may be NaN: a chunk with no labelled token). All zero: sizes are used.
        output_rules: ``{path: rule}`` for outputs the rules cannot read from shapes and
            values, by the path the messages print (``"output[1][0]"``): an int is the
            output's batch dimension, ``"sum"``, ``"mean"``, ``"stack"`` reduce it (one shape
            on every replica), ``"all"``, ``"any"`` reduce booleans, ``"same"`` keeps one copy
            (the replicas must agree), ``"list"`` keeps one per replica.
        module: the module that made the outputs; its RNN layers tell a hidden state
            ``(layers*directions, batch, hidden)`` from a batched output where an even
            split makes the two shapes alike.

    Returns:
        One output with the replicas' structure and types.

    Raises:
        ValueError: a bad argument, replicas that disagree on structure, or tensors that can
            neither be told equal nor concatenated. The message names the output path.

    >>> import torch
    >>> parts = [{"y": torch.ones(2, 3), "loss": torch.tensor(1.0), "n": 10},
    ...          {"y": torch.zeros(1, 3), "loss": torch.tensor(4.0), "n": 10}]
    >>> out = gather(parts, "cpu")
    >>> out["y"].shape, out["loss"], out["n"]
    (torch.Size([3, 3]), tensor(2.), 10)
    """
    scalars = check_scalars(scalars)
    if isinstance(outputs, (str, bytes, Mapping, torch.Tensor, np.ndarray)) or not isinstance(
        outputs, Sequence
    ):
        raise TypeError(
            f"outputs: expected a list with one output per replica, got "
            f"{type(outputs).__name__}; wrap a single output as [output]"
        )
    values = list(outputs)
    if not values:
        raise ValueError("outputs: expected at least one replica's output, got an empty list")
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise ValueError(f"dim: expected an int (the batch dimension), got {dim!r}; pass e.g. 0")
    dim = operator.index(dim)
    target = resolve_target(target_device)
    sizes = None if chunk_sizes is None else check_gather_sizes(chunk_sizes, len(values))
    rules = check_output_rules(output_rules)
    return gather_outputs(values, target, dim, sizes, scalars, scalar_weights, rules, module)


def gather_outputs(
    outputs: list[Any],
    target: torch.device,
    dim: int,
    sizes: Sequence[int] | None,
    scalars: ScalarMode,
    scalar_weights: Sequence[float] | None = None,
    output_rules: Mapping[str, int | str] | None = None,
    module: nn.Module | None = None,
    origins: Any = None,
) -> Any:
    """The pipeline's gather: ``gather`` for arguments already checked (``DataParallel``
    checks them once, at construction), with the cheapest rule that applies chosen here, not by
    the caller.

    One replica's output comes back as the module gave it (tensors moved to ``target``) unless
    ``"stack"`` or ``output_rules`` ask for more; outputs that are all plain tensors batched
    along ``dim`` are concatenated (rule 1); anything else takes the rules' walk. ``sizes`` is
    ``None`` when the chunk sizes are not known (read from the outputs then). ``origins`` (a
    ``dataparallel.gather._origins.Origins``) tells a buffer or input each replica received from a
    value it computed, for scalars that are not one object on every replica.
    """
    try:
        if len(outputs) == 1 and scalars != "stack" and not output_rules:
            out = outputs[0]
            if type(out) is torch.Tensor and out.device == target:  # the common one-device call
                return out
            return to_target(out, target, None)
        if sizes is None:
            found = [first_batch_size(v, dim) for v in outputs]
            sizes = None if None in found else tuple(found)  # type: ignore[arg-type]
        elif not output_rules:
            out = _concat_batched(outputs, target, dim, sizes)
            if out is not None:
                return out
        weights = (
            None if scalar_weights is None else check_scalar_weights(scalar_weights, len(outputs))
        )
        ctx = _Context(
            target, dim, None if sizes is None else tuple(sizes), scalars, len(outputs), weights
        )
        ctx.module, ctx.rules = module, dict(output_rules) if output_rules else None
        ctx.origins = origins
        out = _gather(outputs, None, ctx)
        if ctx.rules:
            warn_unmatched(ctx.rules, ctx.seen)
        return out
    except (RecursionError, TooDeep):
        pass  # raised below, outside the handler, so the message is not chained to it
    raise _too_deep()


def _too_deep() -> ValueError:
    return ValueError(
        "outputs: nested deeper than Python's recursion limit, or a container that contains "
        "itself, expected a tree of tuples, lists, dicts and dataclasses; return a flatter "
        "output, or use gather=False"
    )


def _concat_batched(
    outputs: Sequence[Any], target: torch.device, dim: int, sizes: Sequence[int]
) -> torch.Tensor | None:
    """``gather(outputs, target, dim, chunk_sizes=sizes)`` when every output is a plain tensor
    whose size along ``dim`` is its chunk's (rule 1: concatenated on ``target``), for arguments
    already checked; ``None`` when another rule may apply (the caller then calls ``gather``)."""
    moves = False
    for v, size in zip(outputs, sizes, strict=True):
        if type(v) is not torch.Tensor:
            return None
        shape = v.shape  # (read once: each read builds a torch.Size)
        ndim = len(shape)
        if not (-ndim <= dim < ndim and shape[dim] == size):
            return None
        if dim == 0 and ndim == 3 and shape[1] == size:
            return None  # an RNN state's shape too: gather's rule decides
        moves = moves or v.device != target
    try:
        if moves:
            return torch.cat([v if v.device == target else v.to(target) for v in outputs], dim)
        return torch.cat(cast(list[torch.Tensor], outputs), dim)
    except RuntimeError:  # e.g. other sizes disagree: gather names the path and shapes
        return None


def first_batch_size(obj: Any, dim: int) -> int | None:
    """The size along ``dim`` of the first tensor or ndarray that has one, depth first."""
    cls = type(obj)
    first = obj[0] if (cls is tuple or cls is list) and obj else obj
    if type(first) is torch.Tensor and -first.ndim <= dim < first.ndim:
        # The common output, a plain tensor or a plain tuple or list that starts with one:
        # that tensor is the first leaf, as the walk below would find.
        return int(first.shape[dim])
    for leaf in leaves(obj):
        kind = kind_of(leaf)
        if kind in (TENSOR, ARRAY) and -leaf.ndim <= dim < leaf.ndim:
            return int(leaf.shape[dim])
    return None


# ---------------------------------------------------------------------------- the walk


def _gather(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    if ctx.rules is not None:
        where = fmt(path)
        ctx.seen.append(where)
        if where in ctx.rules:
            return apply_rule(values, where, ctx.rules[where], ctx, _concat)
    cls = type(values[0])
    kind = kind_of(values[0])
    for value in values:
        if type(value) is not cls:
            if kind_of(value) != kind:
                return _gather_mixed(values, path, ctx)
            if kind in STRUCTURES:  # a dict and an OrderedDict, two namedtuple classes
                raise _mismatch(path, "type", [type(v).__name__ for v in values])
    return _HANDLERS[kind](values, path, ctx)


def _gather_arrays(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rules 1 and 3 for tensors and ndarrays (0-dim ones are scalars, rule 2)."""
    if all(v.ndim == 0 for v in values):
        return gather_scalars(values, path, ctx)
    is_tensor = isinstance(values[0], torch.Tensor)
    if is_tensor:
        target = ctx.target
        # A plain tensor already on the target is what ``.to`` would return: itself.
        values = [
            v if type(v) is torch.Tensor and v.device == target else v.to(target) for v in values
        ]
    if ctx.dim == 0 and ctx.sizes is not None and hidden_state(values, path, ctx):
        return _concat(values, path, 1, ctx)  # (layers*directions, batch, hidden)
    if not _batched(values, ctx):
        if arrays_equal(values):
            return values[0]
        if ctx.sizes is not None:
            check_chunk_sizes_of(values, lambda: fmt(path), ctx.dim, ctx.sizes)
        _warn_concat(values, path, ctx)
    try:
        if is_tensor:
            return torch.cat(values, ctx.dim)
        return np.concatenate(values, axis=ctx.dim)
    except (RuntimeError, ValueError) as exc:
        raise concat_error(values, fmt(path), ctx.dim, ctx.sizes) from exc


def _concat(values: list[Any], path: _Path, dim: int, ctx: _Ctx, where: str = "") -> Any:
    try:
        if isinstance(values[0], torch.Tensor):
            return torch.cat([v.to(ctx.target) for v in values], dim)
        return np.concatenate(values, axis=dim)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise concat_error(values, where or fmt(path), dim, ctx.sizes) from exc


def _batched(values: list[Any], ctx: _Ctx) -> bool:
    if ctx.sizes is None:
        return False
    dim = ctx.dim
    for v, size in zip(values, ctx.sizes, strict=True):  # a loop: no generator to start
        ndim = v.ndim
        if not (-ndim <= dim < ndim and v.shape[dim] == size):
            return False
    return True


def _warn_concat(values: list[Any], path: _Path, ctx: _Ctx) -> None:
    dim = ctx.dim
    shapes = [tuple(v.shape) for v in values]
    ndim = len(shapes[0])
    ok = -ndim <= dim < ndim and all(len(s) == ndim for s in shapes)
    if ok:
        d = dim % ndim
        ok = len({s[:d] + s[d + 1 :] for s in shapes}) == 1
    if not ok:
        listing = ", ".join(f"replica {i} has shape {s}" for i, s in enumerate(shapes))
        raise ValueError(
            f"{fmt(path)}: cannot concatenate the replicas' outputs along dim {dim}: "
            f"{listing}; expected the same shape on every replica except along dim {dim}. "
            f"Return the same value on every replica, a batch-sized one, or use gather=False "
            f"to handle the per-replica outputs yourself"
        )
    sizes = "unknown" if ctx.sizes is None else list(ctx.sizes)
    warn_user(
        f"{fmt(path)}: the replicas returned different values of shapes {shapes}, whose size "
        f"along dim {dim} is not their chunk size (chunk sizes: {sizes}); concatenated them "
        f"along dim {dim}, as torch.nn.DataParallel does. If this output is not batched, "
        f"return the same value on every replica; if it is, give it the chunk size along dim "
        f"{dim}; or use gather=False to handle the per-replica outputs yourself"
    )


def _gather_others(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rule 6: once if equal on every replica, else one per replica."""
    return values[0] if all_equal(values) else list(values)


def _gather_mixed(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    kinds = [kind_of(v) for v in values]
    if all(k in (NONE, SHAPE, OTHER) for k in kinds):
        return _gather_others(values, path, ctx)
    if all(
        k in (NUMBER, BOOL) or (k in (TENSOR, ARRAY) and v.ndim == 0)
        for k, v in zip(kinds, values, strict=True)
    ):
        return gather_scalars(values, path, ctx)  # e.g. a loss that is 0.0 on one replica
    raise _mismatch(path, "type", [type(v).__name__ for v in values])


def _mismatch(path: _Path, what: str, found: list[Any]) -> ValueError:
    listing = ", ".join(f"replica {i} has {item}" for i, item in enumerate(found))
    return ValueError(
        f"{fmt(path)}: replicas disagree on the {what}: {listing}; expected the same "
        f"structure from every replica. Make forward return the same {what} on every replica, "
        f"or use gather=False to handle the per-replica outputs yourself"
    )


def _gather_lists(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rule 4: per-sample lists are concatenated; same-length lists are structure. Where the
    chunk sizes are unknown (``gather`` without ``chunk_sizes`` on outputs with no batched
    tensor), nothing tells the two apart: the replicas' lists are concatenated in replica
    order (accelerate's ``gather_object``), except lists of 0-dim tensors (losses, metrics)."""
    first = values[0]
    if ctx.sizes is None:
        if not _all_scalar_tensors(values):
            return _concat_lists(values, path, ctx)
    else:
        types = _per_sample(values, ctx.sizes, ctx.dim)
        if types is not None:
            return _concat_lists(values, path, ctx, types)
    n = len(first)
    if any(len(v) != n for v in values):
        return _concat_lists(values, path, ctx)
    items = [_gather([v[i] for v in values], (path, "[", i), ctx) for i in range(n)]
    return rebuild_at(path, rebuild_sequence, first, items)


def _all_scalar_tensors(values: list[Any]) -> bool:
    """Whether every replica's list is non-empty and holds only 0-dim tensors or ndarrays."""
    return all(
        value and all(isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 0 for x in value)
        for value in values
    )


def _per_sample(values: list[Any], sizes: tuple[int, ...], dim: int) -> list[set[type]] | None:
    """Whether the replicas' lists are per-sample: ``None`` when not, else each list's set of
    item types (for ``_concat_lists``)."""
    if any(len(v) != size for v, size in zip(values, sizes, strict=True)):
        return None
    found: list[set[type]] = []
    for value, size in zip(values, sizes, strict=True):
        types = item_types(value)
        found.append(types)
        if types <= ATOMS:
            continue  # strings, numbers: no tensor to look at
        if value and all(isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 0 for x in value):
            return None  # 0-dim tensors are scalars (losses, metrics): the list is structure
        if types == {torch.Tensor} and dim >= 0:
            if _any_batched(value, dim, size):
                return None  # a batched tensor: the list is structure (torch's reading)
            continue
        for item in value:
            if (
                isinstance(item, (torch.Tensor, np.ndarray))
                and -item.ndim <= dim < item.ndim
                and item.shape[dim] == size
            ):
                return None  # a batched tensor: the list is structure (torch's reading)
    return found


def _any_batched(tensors: list[torch.Tensor], dim: int, size: int) -> bool:
    """Whether any of ``tensors`` (all exact ``torch.Tensor``, ``dim >= 0``) has ``size``
    along ``dim``."""
    try:
        # Every shape read at C speed. A tensor without dim ``dim`` (IndexError) or without
        # sizes (a nested tensor: RuntimeError) fails it: the item-by-item reading below then
        # decides, as if this line were not there (reading a shape changes nothing).
        return size in map(operator.itemgetter(dim), map(_SHAPE, tensors))
    except Exception:
        return any(t.ndim > dim and t.shape[dim] == size for t in tensors)


def _concat_lists(
    values: list[Any], path: _Path, ctx: _Ctx, types_of: list[set[type]] | None = None
) -> Any:
    """The replicas' lists joined in order, tensors moved to the target. ``types_of``: each
    list's set of item types, when the caller has read them."""
    target = ctx.target
    items: list[Any] = []
    for i, value in enumerate(values):
        types = item_types(value) if types_of is None else types_of[i]
        if types <= ATOMS:
            items.extend(value)  # nothing to move
        elif types == {torch.Tensor} and target == _CPU and all(map(_IS_CPU, value)):
            # Every tensor is on the CPU (whose tensors all report device(type='cpu'), never
            # an index): each is already on ``target``, as the line below would find.
            items.extend(value)
        elif types == {torch.Tensor}:
            # What to_target does for a tensor, minus the call when it is already there.
            items.extend([t if t.device == target else t.to(target) for t in value])
        else:
            items.extend([to_target(item, target, path) for item in value])
    return rebuild_at(path, rebuild_sequence, values[0], items)


def _gather_tuples(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rule 5 for tuples and namedtuples."""
    first = values[0]
    if is_packed(first):  # sequences, not a namedtuple of four batched fields
        return gather_packed(values, ctx.target)
    n = len(first)
    if any(len(v) != n for v in values):
        raise _mismatch(path, "length", [f"length {len(v)}" for v in values])
    if n == 2 and type(first) is tuple and ctx.sizes is not None:
        note_roles(first, path, ctx)  # where an RNN's (output, state) may be
    names = getattr(type(first), "_fields", None)
    items = [
        _gather([v[i] for v in values], (path, ".", names[i]) if names else (path, "[", i), ctx)
        for i in range(n)
    ]
    return rebuild_at(path, rebuild_sequence, first, items)


def _gather_mappings(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rule 5 for Mappings, and model-output classes (a Mapping that is also a dataclass)."""
    first = values[0]
    keys = first.keys()
    if any(v.keys() != keys for v in values[1:]):
        raise _mismatch(path, "keys", [list(v.keys()) for v in values])
    data = {k: _gather([v[k] for v in values], (path, "[", k), ctx) for k in keys}
    if not dataclasses.is_dataclass(first):
        return rebuild_at(path, rebuild_mapping, first, data)
    extra = _gather_fields(values, path, ctx, [n for n in fields_of(type(first)) if n not in data])
    return rebuild_at(path, rebuild_record, first, extra, data)


def _gather_fields(
    values: list[Any], path: _Path, ctx: _Ctx, names: Iterable[str]
) -> list[tuple[str, Any]]:
    return [(n, _gather([getattr(v, n) for v in values], (path, ".", n), ctx)) for n in names]


def _gather_dataclasses(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rule 5 for dataclasses (frozen ones and init=False fields included)."""
    fields = _gather_fields(values, path, ctx, fields_of(type(values[0])))
    return rebuild_at(path, rebuild_record, values[0], fields)


_HANDLERS: dict[Kind, Callable[[list[Any], _Path, _Ctx], Any]] = {
    NONE: _gather_others,
    TENSOR: _gather_arrays,
    ARRAY: _gather_arrays,
    BOOL: gather_scalars,
    NUMBER: gather_scalars,
    SHAPE: _gather_others,  # a shape is a value, not a tuple of numbers to average
    LIST: _gather_lists,
    TUPLE: _gather_tuples,
    NAMEDTUPLE: _gather_tuples,
    MAPPING: _gather_mappings,
    DATACLASS: _gather_dataclasses,
    RECORD: _gather_mappings,
    OTHER: _gather_others,
}
