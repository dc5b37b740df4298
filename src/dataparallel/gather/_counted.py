"""Outputs computed from ``num_items_in_batch``: marked in forward, summed by gather.

transformers' ``Trainer`` passes ``num_items_in_batch`` (the labelled-token count ``N`` of the
whole batch) and a causal LM returns its chunk's token sum over ``N``: on several replicas each
one's loss is a part of the one-device loss. Whatever forward does with the count (divides by
it, guards it with ``max(N, 1)``, takes a root, uses it as a size, returns it), each replica
must see the count as one device does, so each receives the whole ``N``; what differs is the
gather. An output computed from the count is a part of the one-device value (a sum over the
chunk's items, scaled by the count) and is summed; one that ignores it (a classifier's mean
loss) keeps the usual rules.

To tell the two apart, each replica receives ``N`` as a marked value that behaves as ``N``:
an ``int`` subclass for an int, a ``float`` subclass for a float, a ``torch.Tensor`` subclass
for a tensor. Every result computed from a marked value is marked (tensors through torch's
``__torch_function__`` protocol, numbers through their arithmetic), so gather sees which
outputs depend on the count (``gather_counted``), and the marks are removed there. A
tensor computed from the count and from other tensors (the chunk's data, the parameters) is
marked a part (``CountedPart``) and always summed; one computed from the count alone (the count
returned, ``n ** 0.5``, ``ids.new_ones(n)``) comes back once where the replicas agree. A value
turned into a plain number (``float(n)``, ``n.item()``, ``math.sqrt(n)``) loses its mark: the
call's ``CountRecord`` remembers it, and gather then refuses a floating scalar it cannot place
(``check_unmarked``), naming ``num_items_in_batch`` and the ``output_rules`` entry that settles
it. Only calls that pass the count on two chunks or more pay any of this.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import torch
from torch._tensor import _convert
from torch.utils._pytree import tree_leaves

from dataparallel.gather._outputs import (
    ESCAPES,
    Mark,
    all_equal,
    arrays_equal,
    fmt,
    move,
    retype,
    sum_all,
)

__all__ = [
    "COUNT_KEYWORD",
    "CountRecord",
    "Counted",
    "CountedPart",
    "check_unmarked",
    "gather_counted",
    "is_counted",
    "unmark",
]

COUNT_KEYWORD = "num_items_in_batch"


class CountRecord:
    """One call's marks: the marked types its replicas receive, and how the count was turned
    into a plain number (``escaped``), if it was."""

    __slots__ = ("_types", "escaped")

    def __init__(self) -> None:
        self.escaped: str | None = None
        # Types made per call (on first need), so each mark knows its call's record (two
        # wrappers may run at once): results of torch ops keep the most derived subclass.
        self._types: dict[type, type] = {}

    def _type(self, base: Any) -> Any:
        made = self._types.get(base)
        if made is None:
            made = self._types[base] = type(base.__name__, (base,), {"record": self})
        return made

    @property
    def tensor_type(self) -> type[Counted]:
        return self._type(Counted)

    @property
    def part_type(self) -> type[CountedPart]:
        return self._type(CountedPart)

    @property
    def int_type(self) -> type[_CountInt]:
        return self._type(_CountInt)

    @property
    def float_type(self) -> type[_CountFloat]:
        return self._type(_CountFloat)

    def mark(self, value: Any) -> Any:
        """``value`` (the count a replica receives, already on its device) marked."""
        if isinstance(value, torch.Tensor):
            return retype(value, self.tensor_type)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return self.int_type(int(value))
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return self.float_type(float(value))
        raise TypeError(
            f"{COUNT_KEYWORD}: expected an int, a float or a tensor (the count of items the "
            f"loss divides by), got {type(value).__name__} {value!r:.60}; pass the count as a "
            f"number or a 0-dim tensor"
        )

    def escape(self, how: str) -> None:
        if self.escaped is None:
            self.escaped = how


class Counted(Mark):
    """A tensor computed from the count alone (or the count itself): results of torch ops on
    it are marked too (``_follow``). ``record`` is set on the per-call subclass."""

    record: ClassVar[CountRecord]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in ESCAPES:
            cls.record.escape(f"{COUNT_KEYWORD}.{func.__name__}()")
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def _follow(cls, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        """Tensors come back marked: a part (``CountedPart``) when another tensor, or a part,
        took part in the op."""
        inputs = (args[1:], kwargs) if func in _FACTORIES else (args, kwargs)
        part = any(
            isinstance(x, torch.Tensor)
            and (isinstance(x, CountedPart) or not isinstance(x, Counted))
            for x in tree_leaves(inputs)
        )
        return _convert(out, cls.record.part_type if part else cls.record.tensor_type)


class CountedPart(Counted):
    """A tensor computed from the count and from other tensors (the chunk's data, the
    parameters): a part of the one-device value, summed however the replicas' values compare
    (two chunks of equal data give equal parts, and both count)."""


# Methods whose tensor ``self`` gives only a dtype and a device: ``ids.new_zeros(n)`` is
# computed from the count alone.
_FACTORIES = frozenset(
    {
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
        torch.Tensor.new_empty,
        torch.Tensor.new_tensor,
    }
)


def _torch_function(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """A torch op with a marked number among its arguments: its tensors come back marked, as
    a marked tensor's do."""
    return super(Counted, cls.record.tensor_type).__torch_function__(func, types, args, kwargs)


def _marked(record: CountRecord, out: Any) -> Any:
    if isinstance(out, bool) or out is NotImplemented:
        return out
    if isinstance(out, int):
        return record.int_type(out)
    if isinstance(out, float):
        return record.float_type(out)
    return out


def _arith(base: type, name: str) -> Any:
    op = getattr(base, name)
    as_float = getattr(float, name, None) if base is int else None

    def method(self: Any, *other: Any) -> Any:
        out = op(self, *other)
        if out is NotImplemented and as_float is not None and other:
            # int with a float (``n ** 0.5``, ``n * 0.5``): int answers NotImplemented and
            # Python would ask float, which knows no mark
            out = as_float(float(int.__index__(self)), *other)
        return _marked(self.record, out)

    method.__name__ = name
    return method


def _escape(base: type, name: str, how: str) -> Any:
    op = getattr(base, name)

    def method(self: Any, *other: Any) -> Any:
        self.record.escape(how)
        return op(self, *other)

    method.__name__ = name
    return method


_ARITH = (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__pow__",
    "__rpow__",
    "__neg__",
    "__pos__",
    "__abs__",
    "__round__",
    "__trunc__",
    "__floor__",
    "__ceil__",
)


class _CountInt(int):
    """An int computed from the count (or the count itself): its arithmetic stays marked."""

    __slots__ = ()
    record: ClassVar[CountRecord]


class _CountFloat(float):
    """A float computed from the count (``n ** 0.5``): its arithmetic stays marked."""

    __slots__ = ()
    record: ClassVar[CountRecord]


def _install(cls: type, base: type) -> None:
    """``cls``'s arithmetic (each result marked), its torch ops, and its escapes."""
    for name in _ARITH:
        if hasattr(base, name):
            setattr(cls, name, _arith(base, name))
    extra = {
        "__torch_function__": classmethod(_torch_function),
        "__float__": _escape(base, "__float__", f"float({COUNT_KEYWORD}) or math.*"),
        "__int__": _escape(base, "__int__", f"int({COUNT_KEYWORD})"),
        "__reduce__": lambda self: (base, (base(self),)),  # pickled as the plain number
    }
    for name, method in extra.items():
        setattr(cls, name, method)


_install(_CountInt, int)
_install(_CountFloat, float)


def is_counted(value: Any) -> bool:
    """Whether ``value`` is marked as computed from the count."""
    return isinstance(value, (Counted, _CountInt, _CountFloat))


def unmark(value: Any) -> Any:
    """``value`` without its mark, whichever (the count's or ``_terms``'): a plain tensor,
    int or float; others as they are."""
    if isinstance(value, Mark):
        return retype(value, torch.Tensor)
    if isinstance(value, _CountInt):
        return int(int.__index__(value))
    if isinstance(value, _CountFloat):
        return float.__float__(value)
    return value


def gather_counted(values: list[Any], path: Any, ctx: Any, batched: Any) -> Any:
    """The replicas' values at ``path``, one of them at least computed from the count.

    A part of the one-device value is summed: a loss divided by the count, guarded or scaled
    by a root of it (scalars), or a per-class sum over it (tensors that are not batched),
    whatever the values (``CountedPart``: computed with other tensors). A value computed from
    the count alone (the count returned, ``n ** 0.5``) is one device's when equal on every
    replica without a gradient, kept once. A batched tensor (each
    replica's has its chunk size along ``dim``) is per-sample: concatenated as always
    (``batched(values) -> output``).
    """
    part = any(isinstance(v, CountedPart) for v in values)  # never a value of the count alone
    plain = [unmark(v) for v in values]
    target = ctx.target
    tensors = [v for v in plain if isinstance(v, torch.Tensor)]
    if tensors and any(t.ndim for t in tensors):
        if all(isinstance(v, torch.Tensor) and v.ndim for v in plain):
            if ctx.sizes is not None and all(
                v.shape[ctx.dim % v.ndim] == n for v, n in zip(plain, ctx.sizes, strict=True)
            ):
                return batched(plain)
            moved = [move(v, target) for v in plain]
            if not part and not any(v.requires_grad for v in moved) and arrays_equal(moved):
                return moved[0]
            return sum_all(moved)
        raise ValueError(
            f"{fmt(path)}: computed from {COUNT_KEYWORD}, but a tensor on some replicas and "
            f"a number or 0-dim tensor on others ({[type(v).__name__ for v in plain]}); "
            f"expected one kind on every replica. Return the same kind from every replica, "
            f"or set output_rules={{{fmt(path)!r}: ...}}"
        )
    if tensors:
        moved = [torch.as_tensor(v, device=target) for v in plain]
        if not part and not any(v.requires_grad for v in moved) and arrays_equal(moved):
            return move(plain[0], target) if isinstance(plain[0], torch.Tensor) else moved[0]
        return sum_all(moved)
    if all_equal(plain):
        return plain[0]
    return sum_all(plain)


def check_unmarked(values: list[Any], path: Any, ctx: Any) -> None:
    """After forward turned the count into a plain number, a floating scalar that differs
    between replicas (or carries a gradient) may be a part of the one-device value, or a mean:
    nothing tells which, so it is refused, naming the ``output_rules`` entry that settles it."""
    record: CountRecord | None = getattr(ctx, "count", None)
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
