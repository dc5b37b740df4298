"""The marks: what forward computed from a chunk's data, its loss terms, and the count.

Each chunk's loss is made of terms; the one-device loss is the same terms over the whole batch.
Which term is which is observed, not guessed: a torch op on a marked argument runs on plain
tensors and its result is marked from its arguments' marks (``_mark_of``), one
``__torch_function__`` for every kind (``_Marked``):

- ``Target``: a chunk's tensors in a call that passes an integer tensor (labels, ids), and
  what is computed from them alone (a shift, ``labels != -100``, ``mask.sum()``); an op that
  mixes in the network's tensors gives plain ones, so the network pays one dispatch at most.
- ``Count``: ``num_items_in_batch``, whole on every replica (or an int or float subclass whose
  arithmetic stays marked), and what is computed from it alone: a constant the replicas agree
  on. ``Part``: computed from the count and anything else (the chunk's sum over ``N``), a term
  whose one part is a ``sum``. A count turned into a Python number is noted (``Record``).
- ``Elements``, ``Term``: torch's loss functions called on a mark run with
  ``reduction="none"`` (``_reductions``), giving per-element values or a term: a ``mean``
  (num, den) or ``sum`` (num) part. Sums, differences and constant multiples of terms keep
  every part; a sum over a count from the data or over another sum is a mean; a sum over a
  Python number is a ``ratio`` (decided at gather); a number or plain tensor added is a
  ``const``; anything else (a product of two means) is ``untold``. Each part is ``(kind, num,
  den, scale)``; how the replicas' parts are gathered is ``_rule``'s.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import torch
from torch._tensor import _convert
from torch.utils._pytree import tree_leaves

from dataparallel.gather._loss._reductions import LOSSES, reduce_apart
from dataparallel.gather._outputs import ESCAPES, Mark, retype

__all__ = [
    "COUNT_KEYWORD",
    "Part",
    "Record",
    "Target",
    "Term",
    "is_counted",
    "is_marked",
    "parts_of",
    "unmark",
]

COUNT_KEYWORD = "num_items_in_batch"


class Record:
    """One call's marks: the count's marked types its replicas receive (made per call, so
    each mark knows its call's record: two wrappers may run at once), and how the count was
    turned into a plain number (``escaped``), if it was."""

    __slots__ = ("_types", "escaped")

    def __init__(self) -> None:
        self.escaped: str | None = None
        self._types: dict[type, type] = {}

    def type_of(self, base: Any) -> Any:
        made = self._types.get(base)
        if made is None:
            made = self._types[base] = type(base.__name__, (base,), {"record": self})
        return made

    def mark(self, value: Any) -> Any:
        """``value`` (the count a replica receives, already on its device) marked."""
        if isinstance(value, torch.Tensor):
            return retype(value, self.type_of(Count))
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return self.type_of(_CountInt)(int(value))
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return self.type_of(_CountFloat)(float(value))
        raise TypeError(
            f"{COUNT_KEYWORD}: expected an int, a float or a tensor (the count of items the "
            f"loss divides by), got {type(value).__name__} {value!r:.60}; pass the count as a "
            f"number or a 0-dim tensor"
        )

    def escape(self, how: str) -> None:
        if self.escaped is None:
            self.escaped = how


class _Marked(Mark):
    """Every mark: a loss function called on one is observed (``_observe``); a marked count
    turned into a number is noted; other torch ops run plain, then are marked (``_mark_of``)."""

    record: ClassVar[Record | None] = None  # the count's marks: their call's record

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        sig = LOSSES.get(func)
        if sig is not None:
            bound = sig.bind(*args, **(kwargs or {}))
            bound.apply_defaults()
            return _observe(func, bound.arguments)
        if func in ESCAPES and cls.record is not None:
            cls.record.escape(f"{COUNT_KEYWORD}.{func.__name__}()")
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def _follow(cls, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        return _mark_of(func, args, kwargs, out)


class Target(_Marked):
    """A chunk's integer input, or a value computed from such inputs alone."""


class Elements(_Marked):
    """Per-element values of a loss function run with ``reduction="none"``."""


class Count(_Marked):
    """``num_items_in_batch`` as a tensor, or a tensor computed from it alone: one value that
    every replica agrees on. ``record`` is set on the per-call subclass."""


class Term(_Marked):
    """A value made of a chunk's loss terms: ``parts`` (kind, num, den, scale), or ``untold``
    (why it cannot be re-formed); ``counted``: ``num_items_in_batch`` took part (re-formed
    whatever ``scalars`` says)."""

    parts: tuple[tuple[str, Any, Any, Any], ...] = ()
    untold: str | None = None
    counted = False


class Part(Term):
    """A tensor computed from the count and from other tensors (the chunk's data, the
    parameters): a part of the one-device value, its own one ``sum`` part (``parts_of``),
    summed however the replicas' values compare (two chunks of equal data give equal parts,
    and both count)."""

    counted = True


def parts_of(value: Term) -> tuple[tuple[str, Any, Any, Any], ...]:
    """A term's parts; a ``Part``'s is its own value, summed."""
    return (("sum", unmark(value), None, 1.0),) if isinstance(value, Part) else value.parts


# -- the count as a number -----------------------------------------------------------------


class _CountInt(int):
    """An int computed from the count (or the count itself): its arithmetic stays marked."""

    __slots__ = ()
    record: ClassVar[Record]


class _CountFloat(float):
    """A float computed from the count (``n ** 0.5``): its arithmetic stays marked."""

    __slots__ = ()
    record: ClassVar[Record]


def _marked_number(record: Record, out: Any) -> Any:
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        return out  # (NotImplemented, a complex)
    return record.type_of(_CountInt if isinstance(out, int) else _CountFloat)(out)


def _arith(base: type, name: str) -> Any:
    op = getattr(base, name)
    as_float = getattr(float, name, None) if base is int else None

    def method(self: Any, *other: Any) -> Any:
        out = op(self, *other)
        if out is NotImplemented and as_float is not None and other:
            # int with a float (``n ** 0.5``, ``n * 0.5``): int answers NotImplemented and
            # Python would ask float, which knows no mark
            out = as_float(float(int.__index__(self)), *other)
        return _marked_number(self.record, out)

    method.__name__ = name
    return method


def _escape(base: type, name: str, how: str) -> Any:
    op = getattr(base, name)

    def method(self: Any, *other: Any) -> Any:
        self.record.escape(how)
        return op(self, *other)

    method.__name__ = name
    return method


def _number_torch_function(
    cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None
) -> Any:
    """A torch op with a marked number among its arguments: marked as a ``Count``'s are."""
    return cls.record.type_of(Count).__torch_function__(func, types, args, kwargs)


_ARITH = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__ "
    "__rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __neg__ __pos__ __abs__ __round__ "
    "__trunc__ __floor__ __ceil__"
)


def _install(cls: type, base: type) -> None:
    """``cls``'s arithmetic (each result marked), its torch ops, and its escapes."""
    methods = {n: _arith(base, n) for n in _ARITH.split() if hasattr(base, n)}
    methods["__torch_function__"] = classmethod(_number_torch_function)
    methods["__float__"] = _escape(base, "__float__", f"float({COUNT_KEYWORD}) or math.*")
    methods["__int__"] = _escape(base, "__int__", f"int({COUNT_KEYWORD})")
    methods["__reduce__"] = lambda self: (base, (base(self),))  # pickled as the plain number
    for name, method in methods.items():
        setattr(cls, name, method)


_install(_CountInt, int)
_install(_CountFloat, float)


def is_counted(value: Any) -> bool:
    """Whether ``value`` was computed from the count (a ``Count``, a ``Part``, a term that
    the count took part in, or a marked number)."""
    return isinstance(value, (Count, _CountInt, _CountFloat)) or (
        isinstance(value, Term) and value.counted
    )


def is_marked(value: Any) -> bool:
    """Whether ``value`` carries any mark."""
    return isinstance(value, (_Marked, _CountInt, _CountFloat))


def unmark(value: Any) -> Any:
    """``value`` without its mark, whichever: a plain tensor, int or float; others as they
    are."""
    if isinstance(value, Mark):
        return retype(value, torch.Tensor)
    if isinstance(value, _CountInt):
        return int(int.__index__(value))
    if isinstance(value, _CountFloat):
        return float.__float__(value)
    return value


# -- how a result is marked -------------------------------------------------------------------

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
# Methods whose tensor ``self`` gives only a dtype and a device: ``ids.new_zeros(n)`` is
# computed from the count alone.
_FACTORIES = frozenset({T.new_zeros, T.new_ones, T.new_full, T.new_empty, T.new_tensor})


def _term(value: Any, parts: tuple[Any, ...], untold: str | None = None) -> Term:
    out = retype(value, Term)
    out.parts, out.untold = parts, untold
    return out


def _observe(func: Any, a: dict[str, Any]) -> Any:
    """A torch loss function called with a marked argument: its chunk's term."""
    a = {k: unmark(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    with torch._C.DisableTorchFunctionSubclass():
        if a.get("size_average") is not None or a.get("reduce") is not None:
            return func(**a)  # the legacy arguments: left as torch reads them
        total, den, elements = reduce_apart(func, a)
    if elements:
        return retype(total, Elements)
    if den is None:
        return _term(total, (("sum", total, None, 1.0),))
    return _term(total / den, (("mean", total, den, 1.0),))


def _mark_of(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """The mark of ``func``'s result, from the marks of its arguments."""
    found = _tensors(args, kwargs)
    if any(isinstance(x, Term) for x in found):
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
    record = _record((*found, *args, *kwargs.values()))
    if record is not None:  # computed from the count: alone, or with anything else
        inputs = (args[1:], kwargs) if func in _FACTORIES else (args, kwargs)
        alone = all(
            isinstance(x, Count) for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)
        )
        return _convert(out, record.type_of(Count if alone else Part))
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


def _record(inputs: Any) -> Record | None:
    """The call's record where the count took part in an op (a marked tensor or number)."""
    for x in inputs:
        if isinstance(x, (Count, _CountInt, _CountFloat)):
            return x.record
    return None


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
        return None if x.untold is not None or x.numel() != 1 else parts_of(x)
    if isinstance(x, (Target, Elements)):
        return None
    if isinstance(x, torch.Tensor) and x.numel() != 1:
        return None
    return (("const", unmark(x), None, 1.0),)


def _scaled(parts: tuple[Any, ...], by: Any) -> tuple[Any, ...]:
    return tuple((k, n, d, s * by) for k, n, d, s in parts)


def _combine(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """A term's arithmetic: re-formed parts, or an untellable term naming the op; a value
    the count took part in that is not one number stays a ``Part``."""
    if func in ESCAPES or not isinstance(out, torch.Tensor):
        return out
    a = args[0] if args else None
    b = args[1] if len(args) > 1 else kwargs.get("other")
    found = _tensors(args, kwargs)
    counted = any(map(is_counted, found)) or is_counted(b)
    if out.numel() != 1 or any(isinstance(x, Part) and x.numel() != 1 for x in found):
        return _convert(out, Part) if counted else out  # (a per-class sum over the count)
    if not (out.is_floating_point() or out.is_complex()):
        return out
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
    out.counted = counted
    return out


def _held(a: Any, out: Any, parts: tuple[Any, ...], untold: str | None = None) -> Term:
    """The result's term; an in-place op (``loss += aux``, ``loss.add_(aux)``) changes the
    term it was called on, which its caller may keep."""
    if out is a and type(a) is Term:
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
            pb = _parts(b)
            if pb is None or len(pb) != 1 or pb[0][0] != "sum":
                return None
            return (("mean", num * scale, pb[0][1] * pb[0][3], 1.0),)
        return (("mean", num * scale, unmark(b).reshape(()), 1.0),)
    if isinstance(b, (Target, Term, Elements)):
        return None
    if isinstance(b, numbers.Real) and not is_counted(b) and not isinstance(b, bool):
        # a Python number: a constant, or a count that left the tensors (decided at gather)
        return tuple(
            ("ratio", n * s, float(b), 1.0) if k == "sum" else (k, n, d, s / b) for k, n, d, s in pa
        )
    return _scaled(pa, 1 / unmark(b))
