"""How a scalar output is gathered: the one place that decides, rule by rule.

A floating 0-dim or ``(1,)`` output (a loss, a metric) is one device's value when the replicas'
values are combined as forward built them. The first rule that holds decides:

1. ``output_rules={path: ...}``: the user's rule for the path (``_walk``, before any other).
2. **Computed from ``num_items_in_batch``** (``_marks``' ``Count``, ``Part`` and marked
   numbers), unless a 0-dim term on every replica (rule 3: a 0-dim ``Part`` is a term whose
   one part is a sum): a value of the count alone comes back once where the replicas agree
   (summed where they do not), a part of the one-device value (a per-class sum over ``N``) is
   summed, a batched tensor is concatenated.
3. **Loss terms** forward built (``Term``), under ``scalars="mean"``, or whatever ``scalars``
   says where the count took part: re-formed over the whole batch, part by part (a mean's sums
   over the sum of its denominators, a sum summed, a constant once, a sum over a Python number
   over the sum of those numbers).
4. **Told**: a term that cannot be re-formed (a product of two means, a constant that differs
   between chunks, a count that became a Python number and differs): one warning per place,
   naming the output, the term and the fix, and the chunk-size mean kept.
5. **Refused**: a plain floating scalar that differs between replicas after forward turned the
   count into a plain number (nothing tells a part from a mean), naming ``output_rules``.
6. **Plain**: ``scalars="sum"`` sums, ``"stack"`` stacks, ``"mean"`` (the default) weighs each
   chunk by its size, or by ``scalar_weights=`` (the user's override, which marks nothing and
   is called only when a mean needs it), exact for a mean over samples.

Rules 2 to 4 are ``gather_marked`` (the walk calls it for values that carry a mark), rules 5 and
6 ``refuse_escaped`` and ``mean_of`` (``_scalars`` calls them for plain floating scalars).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from dataparallel._common.warn import warn_user
from dataparallel.gather._loss._inputs import passes_integers
from dataparallel.gather._loss._marks import (
    COUNT_KEYWORD,
    Part,
    Record,
    Term,
    is_counted,
    parts_of,
    unmark,
)
from dataparallel.gather._outputs import all_equal, arrays_equal, fmt, sum_all

__all__ = [
    "gather_marked",
    "mean_of",
    "refuse_escaped",
    "said_note",
    "say",
    "summing_note",
    "terms_note",
]


def gather_marked(values: list[Any], path: Any, ctx: Any, walk: Callable[[list[Any]], Any]) -> Any:
    """The replicas' values at ``path``, one at least marked (rules 2 to 4); ``walk(plain
    values)`` gathers them by the rules for their kind where no mark decides."""
    counted = any(map(is_counted, values))
    if counted and not all(isinstance(v, Term) and v.ndim == 0 for v in values):
        return _gather_counted(values, path, ctx, walk)  # rule 2
    if any(isinstance(v, Term) for v in values) and (ctx.scalars == "mean" or counted):
        return _gather_terms(values, path, ctx, walk)  # rules 3 and 4
    return walk([unmark(v) for v in values])  # marked data passed through


def _gather_counted(values: list[Any], path: Any, ctx: Any, walk: Any) -> Any:
    """Rule 2: a part of the one-device value is summed whatever the values (``Part``: two
    chunks of equal data give equal parts, and both count); a value computed from the count
    alone is one device's when equal on every replica without a gradient, kept once; a
    batched tensor (each replica's has its chunk size along ``dim``) is concatenated."""
    part = any(isinstance(v, Part) for v in values)  # never a value of the count alone
    plain = [unmark(v) for v in values]
    tensors = [v for v in plain if isinstance(v, torch.Tensor)]
    if any(t.ndim for t in tensors):
        if not all(isinstance(v, torch.Tensor) and v.ndim for v in plain):
            raise ValueError(
                f"{fmt(path)}: computed from {COUNT_KEYWORD}, but a tensor on some replicas "
                f"and a number or 0-dim tensor on others ({[type(v).__name__ for v in plain]}); "
                f"expected one kind on every replica. Return the same kind from every replica, "
                f"or set output_rules={{{fmt(path)!r}: ...}}"
            )
        if ctx.sizes is not None and all(
            v.shape[ctx.dim % v.ndim] == n for v, n in zip(plain, ctx.sizes, strict=True)
        ):
            return walk(plain)
    if tensors:  # (as_tensor moves a tensor as .to does, and makes one of a number)
        plain = [torch.as_tensor(v, device=ctx.target) for v in plain]
    grad = any(getattr(v, "requires_grad", False) for v in plain)
    agreed = arrays_equal(plain) if tensors else all_equal(plain)
    if not part and not grad and agreed:
        say(ctx, path, f"kept once: computed from {COUNT_KEYWORD} alone, equal on every replica")
        return plain[0]
    say(ctx, path, f"summed: a part of the one-device value, computed from {COUNT_KEYWORD}")
    return sum_all(plain)


def _gather_terms(values: list[Any], path: Any, ctx: Any, walk: Any) -> Any:
    """Rules 3 and 4: the replicas' loss terms re-formed over the batch; told, and their
    chunk-size mean (``walk``), where they cannot be."""
    first = values[0]
    shapes = [tuple(p[0] for p in parts_of(v)) if isinstance(v, Term) else None for v in values]
    untold = next((v.untold for v in values if isinstance(v, Term) and v.untold), None)
    if untold is None and (None in shapes or len(set(shapes)) > 1):
        untold = "terms that differ between chunks"
    if untold is not None:
        kept = "the whole loss is the chunk-size mean of the chunks' values"
        _tell(path, ctx, untold, kept, values)
        out = walk([unmark(v) for v in values])
        say(ctx, path, f"the chunk-size mean, told at the call: {untold}")
        return out
    parts = [parts_of(v) for v in values]
    said = " + ".join(_KINDS[p[0]] for p in parts[0])
    say(ctx, path, f"re-formed over the whole batch, term by term: {said}")
    total = sum_all([_part([p[k] for p in parts], path, ctx) for k in range(len(parts[0]))])
    if not isinstance(total, torch.Tensor):
        total = torch.as_tensor(total, device=ctx.target)
    first = unmark(first)
    total = total.to(first.dtype)
    if total.shape != first.shape or total._base is not None:
        # A fresh tensor, never a view: a hook on a view (check='s at backward) is lost
        # when the caller changes it in place (Trainer's ``loss *= loss_scale``).
        total = total.reshape(first.shape).clone()
    return total if first.requires_grad else total.detach()


_KINDS = {
    "mean": "a mean (its sums over the sum of its denominators)",
    "sum": "a sum (summed)",
    "ratio": "a sum over a Python number",
    "const": "a constant (once)",
}


def say(ctx: Any, path: Any, how: str) -> None:
    """How the scalar at ``path`` was gathered, kept for ``explain`` where the wrapper keeps
    it (``ctx.said``, by path: the last call's word stands)."""
    if ctx.said is not None:
        ctx.said[path] = how


def _part(parts: list[Any], path: Any, ctx: Any) -> Any:
    """One part of the loss (each replica's ``(kind, num, den, scale)``) over the batch."""
    kind = parts[0][0]
    target = ctx.target

    def moved(x: Any) -> Any:
        return x.to(target) if isinstance(x, torch.Tensor) else x

    nums = [moved(n) * moved(s) for _, n, _, s in parts]
    if kind == "sum":
        return sum_all(nums)
    dens = [moved(d) for _, _, d, _ in parts]
    if kind == "mean":
        return sum_all(nums) / sum_all(dens)
    if kind == "ratio":
        if len(set(dens)) == 1:  # a constant divisor
            return sum_all(nums) / dens[0]
        if ctx.sizes is None or list(dens) != [float(n) for n in ctx.sizes]:
            what = f"a sum divided by a Python number that differs between chunks ({dens})"
            _tell(path, ctx, what, "that term is the chunks' sums over the sum of those numbers")
        return sum_all(nums) / sum(dens)
    consts = [torch.as_tensor(n, device=target) for n in nums]
    if all(torch.equal(c.detach(), consts[0].detach()) for c in consts[1:]):
        return nums[0]  # a term that does not depend on the chunk's data: once
    what = "a term added that differs between chunks and no loss function built"
    _tell(path, ctx, what, "that term is its chunk-size mean")
    return sum_all([c * w for c, w in zip(consts, ctx.weights, strict=True) if w])


def _tell(path: Any, ctx: Any, what: str, kept: str, values: Any = None) -> None:
    """Rule 4: one warning per wrapper and place (``ctx.warned``) for a term not re-formed;
    with the chunks' one-value losses (``values``), by how much another weighing could move
    it."""
    where = fmt(path)
    key = ("loss-term", where, kept)  # (what may name values: once per kind of term)
    if ctx.warned is not None:
        if key in ctx.warned:
            return
        ctx.warned.add(key)
    much = ""
    if values is not None and all(v.numel() == 1 for v in values):
        found = [float(unmark(v).detach().reshape(())) for v in values]
        kept_value = sum(x * w for x, w in zip(found, ctx.weights, strict=True) if w)
        off = max(abs(x - kept_value) for x in found)
        listed = ", ".join(f"{x:.6g}" for x in found)
        much = f" (the chunks' values are {listed}: weighed otherwise, up to {off:.3g} from it)"
    warn_user(
        f"{where}: this loss holds {what}, which cannot be re-formed over the whole batch: "
        f"{kept}{much}, not the one-device value. Pass scalar_weights=lambda args, kwargs: <the "
        f"chunk's weight> to weigh the loss, or return the terms apart"
    )


def refuse_escaped(values: list[Any], path: Any, ctx: Any) -> None:
    """Rule 5: after forward turned the count into a plain number, a floating scalar that
    differs between replicas (or carries a gradient) may be a part of the one-device value, or
    a mean: nothing tells which, so it is refused, naming the ``output_rules`` entry."""
    record: Record | None = ctx.count
    if record is None or record.escaped is None:
        return
    floats = [
        v
        for v in values
        if (isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()))
        or (isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral))
    ]
    if not floats:
        return
    grad = any(isinstance(v, torch.Tensor) and v.requires_grad for v in floats)
    if not grad and all_equal([v.item() if isinstance(v, torch.Tensor) else v for v in values]):
        return
    where = fmt(path)
    raise ValueError(
        f"{where}: forward turned {COUNT_KEYWORD} into a plain number ({record.escaped}), so "
        f"whether this output depends on it cannot be told (each replica received the whole "
        f"count). Keep the count a tensor or number in the arithmetic (loss = total / "
        f"{COUNT_KEYWORD}), or say how to combine it: output_rules={{{where!r}: 'sum'}} for a "
        f"part of the one-device value (a sum over the chunk divided by the count), or "
        f"{{{where!r}: 'mean'}} for a mean over the chunk"
    )


def mean_of(values: list[Any], path: Any, ctx: Any) -> Any:
    """Rule 6's mean: each replica's value weighed by the wrapper's ``scalar_weights`` (the
    user's override, called here, on the first mean of the call: never on a call without a
    scalar to weigh), else by ``ctx.counts`` (chunk sizes, or ``gather``'s ``scalar_weights``).
    Tensors (``as_tensor``'d to the target) weigh by weights, not counts, so a float16 loss
    cannot overflow, and a replica of weight 0 adds nothing, not 0 * NaN (a chunk whose loss
    has no element); numbers by counts."""
    counts = ctx.counts
    if ctx.said is not None:
        alike = ctx.sizes is None and ctx.weigh is None and all(c == 1 for c in counts)
        weighed = ctx.weigh is not None or counts is not ctx.sizes
        say(ctx, path, _ALIKE if alike else _WEIGHED if weighed else _MEAN)
    if ctx.weigh is not None:
        if ctx.weighed is None:
            found = ctx.weigh()
            ctx.weighed = tuple(found) if found is not None and sum(found) > 0 else counts
        counts = ctx.weighed
    if not isinstance(values[0], torch.Tensor):
        return sum_all([v * c for v, c in zip(values, counts, strict=True) if c]) / sum(counts)
    weights = ctx.weights if counts is ctx.counts else [c / sum(counts) for c in counts]
    mean = sum_all([t * w for t, w in zip(values, weights, strict=True) if w])
    if any(t.requires_grad for t in values):
        return mean  # a loss: its gradient must be the weighted one, even where values agree
    first = values[0]
    if first.is_floating_point() or first.is_complex():
        # Keep a constant bit for bit without a device sync: choose on the device.
        same = torch.stack([t.to(first.dtype) for t in values]).eq(first).all()
        return torch.where(same, first, mean)
    # Integer outputs keep their dtype only when equal, which needs one look at the values.
    return first if arrays_equal(values) else mean


_MEAN = "averaged, each chunk weighed by its size (exact for a mean over samples)"
_WEIGHED = "averaged, each chunk weighed by scalar_weights="
_ALIKE = "averaged, each chunk alike (the chunk sizes are not known)"

# -- what explain says ----------------------------------------------------------------------


def said_note(said: dict[Any, str]) -> str:
    """What ``explain`` says about the scalar outputs of the calls so far: how each was
    gathered, by path, at the last call that returned it."""
    lines = "; ".join(f"{fmt(path)}: {how}" for path, how in said.items())
    return f"scalar outputs, as gathered so far: {lines}"


def terms_note(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What ``explain`` says about the scalar outputs of a call on several chunks; ``None``
    where it passes no integer tensor (nothing is marked: a scalar is a chunk-size mean, the
    general rule, exact for a mean over samples, and a note on every call would be noise)."""
    if not passes_integers(inputs, kwargs):
        return None
    return (
        "scalar outputs: a loss that torch's loss functions (cross-entropy, CTC, MSE, ...) "
        "built from this call's integer tensors, and the sums, differences, constant multiples "
        "and ratios forward made of them, is re-formed over the whole batch (each mean's sums "
        "over the sum of its denominators, sums summed, constants once); a term that cannot be "
        "re-formed is told at the call; other floating scalars are averaged by chunk size "
        "(scalar_weights= replaces both)"
    )


def summing_note(value: Any, slot: str | int) -> str:
    """What ``explain`` says about a call that passes ``num_items_in_batch``."""
    found = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    where = f"args[{slot}]" if isinstance(slot, int) else slot
    return (
        f"{COUNT_KEYWORD}={found!r} ({where}): each replica receives the whole count, as one "
        f"device does; outputs computed from it (a loss divided by it) are parts of the "
        f"one-device value and are summed, others follow the gather rules (an output_rules "
        f"entry for a path decides there)"
    )
