"""A loss gathered from how forward built it: each chunk's terms re-formed over the batch.

Design (issue 59). On several replicas each chunk's loss is a number made of terms, and the
one-device loss is the same terms over the whole batch: a mean is each chunk's sum over the sum
of each chunk's denominator, a sum is summed, a term that does not depend on the data counts
once. Which term is which is observed, not guessed, at the only places a loss is made:

- **Marked data** (``Target``): in a call that passes an integer tensor (labels, ids), each
  chunk's tensors are marked as the replica receives them (``mark_inputs``); a call of floats
  alone is not (nothing to mark it costs). An op whose tensors are all marked (a shift,
  ``labels != -100``, ``masked_select``, a count ``mask.sum()``) gives marked results; one that
  mixes in any other tensor (an embedding, attention scores) gives plain ones, so the network's
  own ops pay one dispatch at most, not one each (a ``TorchFunctionMode`` around forward would).
- **Torch's loss functions** (``F.cross_entropy``, ``F.ctc_loss``, ... and so their modules)
  dispatch on a marked target: run here with ``reduction="none"``, they give the chunk's term as
  a numerator sum and the denominator torch's mean divides by (the weighted count of targets
  other than ``ignore_index``; samples for CTC, whose mean is over loss / target length; the
  batch for KL's ``batchmean``; elements otherwise). ``"none"`` gives per-element values
  (``Elements``) whose later ``mean()``/``sum()`` over every element is a term too.
- **What forward makes of terms** (``Term``, a 0-dim tensor holding its ``parts``): sums,
  differences and constant multiples keep every part; a sum divided by a count computed from
  marked data (``(labels >= 0).sum()``) or by another sum is a mean; a sum divided by a Python
  number (``.item()``'s) is decided at gather (equal on every chunk: a constant; each chunk's
  size: a sample mean; else told); a number or plain tensor added is a constant part, counted
  once where every chunk has the same, told otherwise. Anything else (a product of two means,
  as an MoE load-balancing loss, a log or power of a loss) is untellable: told at gather, with
  the chunk-size mean kept.

Kinds of part: ``mean`` (num, den), ``sum`` (num), ``ratio`` (num, a Python number), ``const``
(a value). The gathered loss is the sum of the re-formed parts; ``scalar_weights=`` replaces
all of this (the wrapper does not mark a call it weighs).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch._tensor import _convert

from dataparallel._common.warn import warn_user
from dataparallel.gather._counted import CountRecord, is_counted, unmark
from dataparallel.gather._outputs import ESCAPES, Mark, fmt, retype, sum_all

__all__ = [
    "Term",
    "gather_terms",
    "is_marked",
    "mark_inputs",
    "terms_note",
    "unmark_inputs",
]

# torch's loss functions (their modules call them): each dispatches on a marked argument
_LOSS_NAMES = (
    "cross_entropy nll_loss ctc_loss mse_loss l1_loss smooth_l1_loss huber_loss "
    "binary_cross_entropy binary_cross_entropy_with_logits kl_div soft_margin_loss "
    "multilabel_soft_margin_loss multi_margin_loss poisson_nll_loss gaussian_nll_loss "
    "hinge_embedding_loss margin_ranking_loss cosine_embedding_loss"
)
_LOSSES = {getattr(F, n): inspect.signature(getattr(F, n)) for n in _LOSS_NAMES.split()}
T = torch.Tensor
_ADD = frozenset({T.__add__, T.__radd__, T.add, torch.add, T.__iadd__, T.add_})
_SUB = frozenset({T.__sub__, T.sub, torch.sub, T.__isub__, T.sub_})
_RSUB = frozenset({T.__rsub__})
_MUL = frozenset({T.__mul__, T.__rmul__, T.mul, torch.mul, T.__imul__, T.mul_})
_DIV = frozenset({T.__truediv__, T.div, torch.div, torch.true_divide, T.__itruediv__, T.div_})
_NEG = frozenset({T.__neg__, T.neg, torch.neg})
# Ops that keep a term's value (its dtype, shape or graph aside): the parts stay.
_KEEP = frozenset(
    {T.to, T.float, T.double, T.half, T.bfloat16, T.clone, T.contiguous, T.detach}
    | {T.view, T.reshape, T.squeeze, T.unsqueeze, T.sum, T.mean, torch.sum, torch.mean}
)
_SUMS = frozenset({T.sum, torch.sum, T.nansum, torch.nansum})
_MEANS = frozenset({T.mean, torch.mean})
# Ops that pick from their first tensor by an index of any kind: the data's targets, chosen
# by a matcher (DETR's ``boxes[indices]``), are still the data's.
_SELECT = frozenset({T.__getitem__, T.index_select, torch.index_select, T.gather, torch.gather})


class _Marked(Mark):
    """What the data's marks and the terms share: a loss function called on one is observed
    (``_observe``); other torch ops are run plain, then marked by ``_mark_of``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        sig = _LOSSES.get(func)
        if sig is None:
            return super().__torch_function__(func, types, args, kwargs)
        bound = sig.bind(*args, **(kwargs or {}))
        bound.apply_defaults()
        return _observe(func, bound.arguments)

    @classmethod
    def _follow(cls, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        return _mark_of(func, args, kwargs, out)


class Target(_Marked):
    """A chunk's integer input, or a value computed from such inputs alone."""


class Elements(_Marked):
    """Per-element values of a loss function run with ``reduction="none"``."""


class Term(_Marked):
    """A scalar made of a chunk's loss terms: ``parts`` (kind, num, den, scale), or ``untold``
    (why it cannot be re-formed); ``counted``: ``num_items_in_batch`` took part (re-formed
    whatever ``scalars`` says, as the count's outputs are)."""

    parts: tuple[tuple[str, Any, Any, Any], ...]
    untold: str | None
    counted = False


def is_marked(value: Any) -> bool:
    return isinstance(value, _Marked)


def _term(value: torch.Tensor, parts: tuple[Any, ...], untold: str | None = None) -> Term:
    out = retype(value, Term)
    out.parts, out.untold = parts, untold
    return out


def _observe(func: Any, a: dict[str, Any]) -> Any:
    """A torch loss function called with a marked argument: its chunk's term."""
    a = {k: unmark(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    reduction = a.get("reduction", "mean")
    with torch._C.DisableTorchFunctionSubclass():
        if a.get("size_average") is not None or a.get("reduce") is not None:
            return func(**a)  # the legacy arguments: left as torch reads them
        a["reduction"] = "none"
        losses = func(**a)
        if reduction == "none":
            return retype(losses, Elements)
        if func is F.ctc_loss and reduction == "mean":  # a mean over samples of loss / length
            lengths = torch.as_tensor(a["target_lengths"], device=losses.device)
            total = (losses / lengths.clamp(min=1).to(losses.dtype)).sum()
            den: Any = losses.shape[0] if losses.ndim else 1
        else:
            total = losses.sum()
            den = _denominator(func, a, losses, reduction)
        if den is None:
            return _term(total, (("sum", total, None, 1.0),))
        return _term(total / den, (("mean", total, den, 1.0),))


def _denominator(func: Any, a: dict[str, Any], losses: torch.Tensor, reduction: str) -> Any:
    """What torch's ``reduction`` divides the summed losses by; ``None`` for a sum."""
    if reduction == "sum":
        return None
    if reduction == "batchmean":
        return a["input"].shape[0] if a["input"].ndim else 1
    target = a.get("target")
    by_class = func in (F.cross_entropy, F.nll_loss)
    if by_class and isinstance(target, torch.Tensor) and not target.is_floating_point():
        keep = target != a["ignore_index"]
        weight = a.get("weight")
        if weight is None:
            return keep.sum().to(losses.dtype)
        safe = torch.where(keep, target, torch.zeros_like(target))
        return (weight.to(losses.dtype)[safe] * keep).sum()
    return losses.numel()


def _mark_of(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """The mark of ``func``'s result, from the marks of its arguments."""
    found = _tensors(args, kwargs)
    terms = [x for x in found if isinstance(x, Term)]
    if terms:
        return _combine(func, args, kwargs, out)
    if any(isinstance(x, Elements) for x in found):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        if out.ndim == 0 and func in _SUMS:
            return _term(out, (("sum", out, None, 1.0),))
        if out.ndim == 0 and func in _MEANS:
            total = unmark(args[0]).sum()
            return _term(out, (("mean", total, unmark(args[0]).numel(), 1.0),))
        if out.ndim == 0:
            return _term(out, (), f"{_name(func)} of per-element losses")
        return retype(out, Elements)
    if func in ESCAPES:
        return out
    if func in _DIV and len(args) == 2 and _counts(args[0], args[1], out):
        # a sum over the chunk (written by hand) over a count computed from the data
        return _term(out, (("mean", unmark(args[0]), unmark(args[1]).reshape(()), 1.0),))
    picked = func in _SELECT and isinstance(args[0], Target)
    if not picked and not all(isinstance(x, Target) for x in found):
        # computed with the network's tensors: plain from here on, unless it is integers
        # (no activation is: peft's -100 labels of virtual tokens joined to the labels)
        if not isinstance(out, torch.Tensor) or out.is_floating_point() or out.is_complex():
            return out
        if not any(isinstance(x, Target) for x in found):
            return out
    return _convert(out, Target)


def _counts(a: Any, b: Any, out: Any) -> bool:
    """Whether ``a / b`` is a number over a count: ``a`` a plain floating scalar, ``b`` one
    computed from the data alone."""
    if not isinstance(b, Target) or b.numel() != 1 or isinstance(a, _Marked):
        return False
    return isinstance(a, torch.Tensor) and a.ndim == 0 and out.is_floating_point()


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments, and one list down (``torch.cat([a, b])``)."""
    found = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif type(x) in (list, tuple):
            found.extend(y for y in x if isinstance(y, torch.Tensor))
    return found


def _name(func: Any) -> str:
    return getattr(func, "__name__", repr(func))


def _parts(x: Any) -> tuple[Any, ...] | None:
    """A term's parts, a constant as one part, ``None`` for what cannot be a part."""
    if isinstance(x, Term):
        return None if x.untold is not None else x.parts
    if isinstance(x, (Target, Elements)):
        return None
    if isinstance(x, torch.Tensor) and x.numel() != 1:
        return None
    return (("const", unmark(x), None, 1.0),)


def _scaled(parts: tuple[Any, ...], by: Any) -> tuple[Any, ...]:
    return tuple((k, n, d, s * by) for k, n, d, s in parts)


def _combine(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """A term's arithmetic: re-formed parts, or an untellable term naming the op."""
    if func in ESCAPES or not isinstance(out, torch.Tensor):
        return out
    if out.numel() != 1 or not (out.is_floating_point() or out.is_complex()):
        return out
    a = args[0] if args else None
    b = args[1] if len(args) > 1 else kwargs.get("other")
    pa, pb = _parts(a), _parts(b)
    parts: tuple[Any, ...] | None = None
    if func in _KEEP and isinstance(a, Term):
        parts = pa
    elif func in _NEG and pa is not None:
        parts = _scaled(pa, -1.0)
    elif "alpha" in kwargs:
        parts = None
    elif func in _ADD and pa is not None and pb is not None:
        parts = pa + pb
    elif func in _SUB and pa is not None and pb is not None:
        parts = pa + _scaled(pb, -1.0)
    elif func in _RSUB and pa is not None and pb is not None:
        parts = _scaled(pa, -1.0) + pb
    elif func in _MUL and pa is not None and pb is not None:
        parts = _product(a, b, pa, pb)
    elif func in _DIV and pa is not None:
        parts = _ratio(a, b, pa)
    if parts is None:
        told = [x.untold for x in (a, b) if isinstance(x, Term) and x.untold]
        if not told and func in _MUL:
            told = ["a product of two loss terms (an MoE's load-balancing loss is one)"]
        out = _held(a, out, (), told[0] if told else f"{_name(func)} of a loss term")
    else:
        out = _held(a, out, parts)
    out.counted = any(getattr(x, "counted", False) or is_counted(x) for x in (a, b))
    return out


def _held(a: Any, out: Any, parts: tuple[Any, ...], untold: str | None = None) -> Term:
    """The result's term; an in-place op (``loss += aux``, ``loss.add_(aux)``) changes the
    term it was called on, which its caller may keep."""
    if out is a and isinstance(a, Term):
        a.parts, a.untold = parts, untold
        return a
    return _term(out, parts, untold)


def _product(a: Any, b: Any, pa: tuple[Any, ...], pb: tuple[Any, ...]) -> Any:
    if not isinstance(a, Term):
        a, pa, pb = b, pb, pa
    if isinstance(b, Term) and isinstance(a, Term):
        return None  # a product of two terms (an MoE's load-balancing loss)
    return _scaled(pa, pb[0][1])


def _ratio(a: Any, b: Any, pa: tuple[Any, ...]) -> Any:
    """``a / b`` with ``a`` a term: by a constant, a count from the data, or another sum."""
    if not isinstance(a, Term):
        return None
    if isinstance(b, (Target, Term)) and b.numel() == 1 and len(pa) == 1 and pa[0][0] == "sum":
        _, num, _, scale = pa[0]
        if isinstance(b, Term):
            if len(b.parts) != 1 or b.parts[0][0] != "sum" or b.untold is not None:
                return None
            return (("mean", num * scale, b.parts[0][1] * b.parts[0][3], 1.0),)
        return (("mean", num * scale, unmark(b).reshape(()), 1.0),)
    if isinstance(b, (Target, Term, Elements)):
        return None
    if isinstance(b, numbers.Real) and not is_counted(b) and not isinstance(b, bool):
        # a Python number: a constant, or a count that left the tensors (decided at gather)
        return tuple(
            ("ratio", n * s, float(b), 1.0) if k == "sum" else (k, n, d, s / b) for k, n, d, s in pa
        )
    b = unmark(b)
    return _scaled(pa, 1 / b)


# -- the wrapper's side ---------------------------------------------------------------------


def _mark(value: Any) -> Any:
    return retype(value, Target) if type(value) is torch.Tensor and value.ndim else value


def _leaves(chunk_args: Any, chunk_kwargs: Any) -> Any:
    """A chunk's arguments, at the top and one plain list, tuple or dict down."""
    for value in (*(chunk_args or ()), *(chunk_kwargs or {}).values()):
        kind = type(value)
        if kind is list or kind is tuple:
            for v in value:
                yield from v.values() if type(v) is dict else (v,)
        else:
            yield from value.values() if kind is dict else (value,)


def _integers(value: Any) -> bool:
    return type(value) is torch.Tensor and value.ndim > 0 and value.dtype not in _NO_TARGET


_NO_TARGET = frozenset(  # tensors that alone do not make a call mark its chunks
    {torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64}
)


def mark_inputs(
    args: Sequence[Any],
    kwargs: Sequence[Any],
    targets: bool = True,
    count: CountRecord | None = None,
    slot: str | int | None = None,
) -> tuple[list[Any], list[Any]]:
    """Each chunk's inputs marked, in one pass: with ``targets``, its tensors (at the top, or
    one plain container down: DETR's list of per-image dicts) where the call passes an integer
    tensor (labels, ids: what a loss in forward needs; a call of floats alone, an image batch,
    is left as it is, at no cost); with ``count``, its copy of ``num_items_in_batch`` (at
    ``slot``, a keyword or a position) with the call's count mark. The containers are copies:
    a chunk's may be the caller's own."""
    targets = targets and bool(args) and any(map(_integers, _leaves(args[0], kwargs[0])))
    if not targets and count is None:
        return list(args), list(kwargs)

    def one(key: Any, value: Any) -> Any:
        if count is not None and key == slot and value is not None:
            return count.mark(value)
        kind = type(value)  # exactly these: a container of the user's class stays as it is
        if not targets:
            return value
        if kind is list or kind is tuple:
            return kind(_dict(v) if type(v) is dict else _mark(v) for v in value)
        return _dict(value) if kind is dict else _mark(value)

    def _dict(d: Mapping[Any, Any]) -> Any:
        return {k: _mark(v) for k, v in d.items()}

    new_args = [tuple(one(*iv) for iv in enumerate(a)) if isinstance(a, tuple) else a for a in args]
    new_kws = [{k: one(k, v) for k, v in kw.items()} if kw else kw for kw in kwargs]
    return new_args, new_kws


def marks_plain(inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """``mark_inputs``' decision for a call of plain tensors only (the warm call's), read from
    the call's own tensors: each chunk's are their parts, of the same dtype and dimensions."""
    return any(map(_integers, inputs)) or (bool(kwargs) and any(map(_integers, kwargs.values())))


def unmark_inputs(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A wrapper's call inside another's replica: its arguments plain (it marks its own)."""
    if not kwargs and len(inputs) == 1 and type(inputs[0]) is torch.Tensor:
        return inputs, kwargs  # the most common call: one plain tensor, which is not marked
    if any(map(is_marked, inputs)) or any(map(is_marked, kwargs.values())):
        return tuple(map(_strip, inputs)), {k: _strip(v) for k, v in kwargs.items()}
    return inputs, kwargs


def _strip(value: Any) -> Any:
    return unmark(value) if is_marked(value) else value  # (the count's marks are the inner's)


def terms_note(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What ``explain`` says about the scalar outputs of a call on several chunks; ``None``
    where it passes no integer tensor (nothing is marked: a scalar is a chunk-size mean, the
    general rule, exact for a mean over samples, and a note on every call would be noise)."""
    if not any(map(_integers, _leaves(inputs, kwargs))):
        return None
    return (
        "scalar outputs: a loss that torch's loss functions (cross-entropy, CTC, MSE, ...) "
        "built from this call's integer tensors, and the sums, differences, constant multiples "
        "and ratios forward made of them, is re-formed over the whole batch (each mean's sums "
        "over the sum of its denominators, sums summed, constants once); a term that cannot be "
        "re-formed is told at the call; other floating scalars are averaged by chunk size "
        "(scalar_weights= replaces both)"
    )


def gather_terms(
    values: list[Any], path: Any, ctx: Any, fallback: Callable[[list[Any]], Any]
) -> Any:
    """The replicas' loss terms at ``path`` re-formed over the batch; ``fallback(plain
    values)`` (the chunk-size mean), told, where they cannot be."""
    first = values[0]
    shapes = [tuple(k for k, *_ in v.parts) if isinstance(v, Term) else None for v in values]
    untold = next((v.untold for v in values if isinstance(v, Term) and v.untold), None)
    if untold is None and (None in shapes or len(set(shapes)) > 1):
        untold = "terms that differ between chunks"
    if untold is None:
        total = sum_all([_part(values, k, path, ctx) for k in range(len(shapes[0] or ()))])
        if not isinstance(total, torch.Tensor):
            total = torch.as_tensor(total, device=ctx.target)
        first = unmark(first)
        total = total.to(first.dtype)
        if total.shape != first.shape or total._base is not None:
            # A fresh tensor, never a view: a hook on a view (check='s at backward) is lost
            # when the caller changes it in place (Trainer's ``loss *= loss_scale``).
            total = total.reshape(first.shape).clone()
        return total if first.requires_grad else total.detach()
    _tell(path, ctx, untold, "the whole loss is the chunk-size mean of the chunks' values", values)
    return fallback([unmark(v) for v in values])


def _part(values: list[Any], k: int, path: Any, ctx: Any) -> Any:
    kind = values[0].parts[k][0]
    parts = [v.parts[k] for v in values]
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
    """One warning per wrapper and place (``ctx.warned``) for a term not re-formed; with the
    chunks' one-value losses (``values``), by how much another weighing could move it."""
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
