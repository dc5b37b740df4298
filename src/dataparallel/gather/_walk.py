"""The gather rules, applied by walking the replicas' outputs together.

``walk`` dispatches once per value on its class (cached) to the handler of its kind: tensors and
ndarrays (rules 1 and 3), scalars (rule 2, ``_scalars``), lists (rule 4), tuples, mappings and
dataclasses (rule 5), anything else (rule 6). It builds argument paths such as
``output['attn']`` only when a message needs one; an ``output_rules`` entry for a path decides
in place of the rules.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
import torch

from dataparallel._common.checks import (
    check_chunk_sizes_of,
    concat_error,
)
from dataparallel._common.kinds import (
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
    fields_of,
    item_types,
    kind_of,
)
from dataparallel._common.packed import gather_packed, is_packed
from dataparallel._common.rebuild import rebuild_mapping, rebuild_record, rebuild_sequence
from dataparallel._common.tree import leaves
from dataparallel._common.warn import warn_user
from dataparallel.gather._loss import gather_marked, is_marked, unmark
from dataparallel.gather._output_rules import (
    apply_rule,
    check_chunk_matrix,
    hidden_state,
    note_roles,
)
from dataparallel.gather._outputs import (
    ATOMS,
    FIELD,
    all_equal,
    arrays_equal,
    fmt,
    fmt_attributes,
    move,
    rebuild_at,
    to_target,
)
from dataparallel.gather._scalars import gather_scalars

__all__ = ["walk"]

_SHAPE = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")  # True for CPU tensors only (not meta, not CUDA)
_CPU = torch.device("cpu")  # equal only to device(type='cpu'), not to 'cpu:0'
# A path is a chain of (parent, accessor, key) tuples, None at the root; it is formatted only
# for a message, so the walk pays nothing for it.
_Path = Any
_Ctx = Any  # a _gather._Context; Any keeps the handler table simple to type


def walk(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """The replicas' values at ``path`` as one, by the rule for their kind (dispatched once per
    value on its class) or by the ``output_rules`` entry for the path."""
    if ctx.rules is not None:
        where = fmt(path)
        ctx.seen.append(where)
        if where in ctx.rules:
            values = [unmark(v) for v in values]  # the user's rule decides: marks go
            return apply_rule(values, where, ctx.rules[where], ctx, _concat)
        alias = fmt_attributes(path)  # a model output's field as an attribute: output.logits
        if alias is not None and alias in ctx.rules:
            ctx.seen.append(alias)
            values = [unmark(v) for v in values]  # the user's rule decides: marks go
            return apply_rule(values, where, ctx.rules[alias], ctx, _concat)
    if any(map(is_marked, values)):  # a loss's terms, the count's values: _loss._rule
        return gather_marked(values, path, ctx, lambda plain: walk(plain, path, ctx))
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
    if _one_per_replica(values, ctx):
        if ctx.scalars == "stack":  # torch's vector: one value per replica
            return torch.cat([move(v, ctx.target) for v in values])
        return gather_scalars(values, path, ctx)  # shape (1,) kept: one device's
    is_tensor = isinstance(values[0], torch.Tensor)
    if is_tensor:
        target = ctx.target
        values = [move(v, target) for v in values]  # (a subclass's own .to is not called)
    if ctx.dim == 0 and ctx.sizes is not None and hidden_state(values, path, ctx):
        return _concat(values, path, 1, ctx)  # (layers*directions, batch, hidden)
    if not _batched(values, ctx):
        if arrays_equal(values):
            return values[0]
        if ctx.sizes is not None:
            check_chunk_sizes_of(values, lambda: fmt(path), ctx.dim, ctx.sizes)
        _warn_concat(values, path, ctx)
    elif is_tensor and ctx.dim in (0, -2):  # (a CLIP similarity matrix inside forward)
        check_chunk_matrix(values, fmt(path), cast(tuple[int, ...], ctx.sizes))
    try:
        if is_tensor:
            return torch.cat(values, ctx.dim)
        return np.concatenate(values, axis=ctx.dim)
    except (RuntimeError, ValueError) as exc:
        raise concat_error(values, fmt(path), ctx.dim, ctx.sizes) from exc


def _one_per_replica(values: list[Any], ctx: _Ctx) -> bool:
    """Tensors of shape ``(1,)`` from every replica, whatever its chunk size, where a chunk has
    more than one sample: not batched, but a scalar kept in one dimension (VQ-VAE-2's
    ``loss.unsqueeze(0)``, the torch-era idiom for DataParallel's vector of losses). Rule 2
    then gathers it as a 0-dim scalar, keeping the shape one device returns, ``(1,)``.
    Where every chunk has one sample the shape cannot tell a per-sample output: rule 1."""
    sizes = ctx.sizes
    if sizes is None or all(n == 1 for n in sizes) or ctx.dim not in (0, -1):
        return False
    return all(type(v) is torch.Tensor and v.shape == (1,) for v in values)


def _concat(values: list[Any], path: _Path, dim: int, ctx: _Ctx, where: str = "") -> Any:
    try:
        if isinstance(values[0], torch.Tensor):
            return torch.cat([move(v, ctx.target) for v in values], dim)
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
        + _flattened_hint(shapes, d, path, ctx)
    )


def _flattened_hint(shapes: list[tuple[int, ...]], d: int, path: _Path, ctx: _Ctx) -> str:
    """Where every replica's size along the dim is one multiple ``k`` of its chunk size, the
    output reads as a batch flattened with the next dimension (the OpenAI transformer LM's
    ``(batch * choices * tokens, vocab)`` logits): that concatenation is one device's, and
    ``output_rules={path: dim}`` says so (no rule can tell it from an unbatched output of that
    size on an even split, so the library does not assume it)."""
    if ctx.sizes is None or 0 in ctx.sizes:
        return ""
    ks = {s[d] // n if s[d] % n == 0 else 0 for s, n in zip(shapes, ctx.sizes, strict=True)}
    if len(ks) != 1 or (k := ks.pop()) < 2:
        return ""
    return (
        f". Each size is {k} times its chunk size, as in a batch flattened with a dimension of "
        f"{k} (a (batch, {k}, ...) output viewed as (batch * {k}, ...)): if that is what it is, "
        f"the concatenation is one device's, and output_rules={{{fmt(path)!r}: {ctx.dim}}} "
        f"says so and silences this warning"
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
    items = [walk([v[i] for v in values], (path, "[", i), ctx) for i in range(n)]
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
        if len(types) > 1 and len({kind_of(x) for x in value}) > 1:
            # items of different kinds are no records of one kind (pix2pixHD's ``[losses,
            # None]``): structure, as the batch rules read such an input
            return None
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
        if _all_batched_inside(value, dim, size) and not _same_inside(values):
            return None  # per-layer (h, c) pairs with the batch on dim 1: structure
    return found


def _all_batched_inside(items: list[Any], dim: int, size: int) -> bool:
    """Whether ``items`` are containers (tuples, lists, dicts) whose every tensor has ``size``
    along ``dim``, at least one each: an RNN's per-layer states, not per-sample records (whose
    tensors, boxes and scores, hold each sample's own count)."""
    for item in items:
        if isinstance(item, (torch.Tensor, np.ndarray)) or type(item) in ATOMS:
            return False
        tensors = [x for x in leaves(item) if isinstance(x, torch.Tensor)]
        if not tensors or any(not -t.ndim <= dim < t.ndim or t.shape[dim] != size for t in tensors):
            return False
    return True


def _same_inside(values: list[Any]) -> bool:
    """Whether every replica's list holds the same tensors (one object, or equal values) as
    the first's: values each replica received (``dp.Shared`` in per-sample records), which
    are not batched even where their size is the chunk size, unlike per-layer states, which
    each replica computes from its own chunk."""
    first = [x for x in leaves(values[0]) if isinstance(x, torch.Tensor)]
    for value in values[1:]:
        tensors = [x for x in leaves(value) if isinstance(x, torch.Tensor)]
        if len(tensors) != len(first):
            return False
        for a, b in zip(first, tensors, strict=True):
            if a is b:
                continue
            if a.shape != b.shape or a.dtype != b.dtype or a.numel() > _SMALL:
                return False
            if not torch.equal(a, b.to(a.device)):
                return False
    return True


# The largest tensor ``_same_inside`` compares by value: the shared values of per-sample
# records are small; a larger one is taken as computed per chunk (torch's reading).
_SMALL = 4096


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
        walk([v[i] for v in values], (path, ".", names[i]) if names else (path, "[", i), ctx)
        for i in range(n)
    ]
    return rebuild_at(path, rebuild_sequence, first, items)


def _gather_mappings(values: list[Any], path: _Path, ctx: _Ctx) -> Any:
    """Rule 5 for Mappings, and model-output classes (a Mapping that is also a dataclass)."""
    first = values[0]
    keys = first.keys()
    if any(v.keys() != keys for v in values[1:]):
        raise _mismatch(path, "keys", [list(v.keys()) for v in values])
    if not dataclasses.is_dataclass(first):
        data = {k: walk([v[k] for v in values], (path, "[", k), ctx) for k in keys}
        return rebuild_at(path, rebuild_mapping, first, data)
    # A model-output class: its fields, set (keys) or None (attributes only), are named
    # output['logits'] alike, and output_rules accepts output.logits too (FIELD).
    data = {k: walk([v[k] for v in values], (path, FIELD, k), ctx) for k in keys}
    names = [n for n in fields_of(type(first)) if n not in data]
    extra = _gather_fields(values, path, ctx, names, FIELD)
    return rebuild_at(path, rebuild_record, first, extra, data)


def _gather_fields(
    values: list[Any], path: _Path, ctx: _Ctx, names: Iterable[str], accessor: str = "."
) -> list[tuple[str, Any]]:
    return [(n, walk([getattr(v, n) for v in values], (path, accessor, n), ctx)) for n in names]


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
