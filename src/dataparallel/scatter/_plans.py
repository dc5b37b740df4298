"""A wrapper's plans, reused while a call's signature holds.

Most training loops call a model with arguments of the same structure and shapes on every
step. The plan (which input is split, which broadcast, the chunk sizes, the warnings, the
program that scatter runs) is then a function of the call's signature alone: the structure of
its arguments (container types, keys, lengths, the kind of each list), the type and shape of
every tensor and ndarray, the types of the other leaves, the devices, ``dim`` and the options.
``call_key`` computes that signature in one walk; ``PlanCache.get`` finds a kept plan for it and
binds it to the call's arguments, or builds one and keeps it as a template that holds none of
the call's values, so no batch is kept alive between calls. Containers are cached like plain
tensors: a dict of 100 tensors is one walk and one comparison.

A plan of one chunk whose program gives back the call's own arguments (the whole batch, every
tensor already on the device, no cast) has its program marked ``identity``: the one-device call
moves nothing, through the same ``take`` as every other call.

``CallPlans`` does the same for the functional ``dp.scatter`` and ``dp.scatter_kwargs`` (one
cache for the process), keeping only keys that hold no user object: classes, strings, exact ints,
shapes, layouts, dtypes and devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from dataparallel._common.kinds import ATOMS, MAPPING, container_kind, item_types, struct_items
from dataparallel._common.movable import contains_record
from dataparallel._common.packed import sequence_count
from dataparallel._common.tree import MAX_DEPTH, contains_array
from dataparallel.markers import Shared, Split
from dataparallel.plan import Plan, build_plan, holds_arrays, list_kind
from dataparallel.scatter._take import take

__all__ = ["CallPlans", "PlanCache", "call_key"]

_MAX_PLANS = 8  # a training and an evaluation call, a last smaller batch: a few signatures
_Tensor = torch.Tensor
_FROZEN = (type(None), bool, int, float, str, torch.dtype)
_SHAPE = attrgetter("shape")
_LAYOUT = attrgetter("layout")
_DEVICE = attrgetter("device")
_KWARGS = object()  # separates the positional arguments' part of a key from the keywords'
_NESTED = object()  # starts the key of a call that is not plain tensors only


class _Uncacheable(Exception):
    """A call whose signature is not worth computing (nested too deep, a cycle): the plan is
    built afresh and names any error."""


def call_key(
    inputs: tuple[Any, ...], kwargs: Mapping[str, Any], dim: int, with_device: bool
) -> tuple[Any, ...] | None:
    """Everything the plan of a call depends on, as a tuple to compare; ``None`` when the
    arguments cannot be keyed (the plan is then built for this call alone).

    ``with_device`` adds each tensor's device: a one-device plan may move nothing, which only
    holds while the tensors stay where they are.

    >>> call_key((torch.zeros(4, 2),), {}, 0, False) == call_key((torch.ones(4, 2),), {}, 0, False)
    True
    >>> call_key((torch.zeros(4, 2),), {}, 0, False) == call_key((torch.ones(5, 2),), {}, 0, False)
    False
    """
    if len(inputs) == 1 and not kwargs and type(inputs[0]) is _Tensor:  # the most common call
        a = inputs[0]
        try:
            return (a.shape, a.layout, a.device) if with_device else (a.shape, a.layout)
        except RuntimeError:  # a nested tensor has no shape to read: the rules name it
            return None
    flat = _plain_tensors(inputs, kwargs, with_device)
    if flat is not None:  # the common call, plain tensors only
        return flat
    parts: list[Any] = [_NESTED]
    walker = _Walker(parts, dim, with_device)
    try:
        walker.values(inputs, 0)
        parts.append(_KWARGS)
        parts.append(tuple(kwargs))
        walker.values(kwargs.values(), 0)
    except Exception:  # odd input: the rules decide, and name what is wrong
        return None
    return tuple(parts)


def _plain_tensors(
    inputs: tuple[Any, ...], kwargs: Mapping[str, Any], with_device: bool
) -> tuple[Any, ...] | None:
    """The key of a call whose arguments are all plain tensors (a few attribute reads each),
    or ``None`` for any other call."""
    parts: list[Any] = []
    try:
        for a in inputs:
            if type(a) is not _Tensor:
                return None
            parts += (a.shape, a.layout, a.device) if with_device else (a.shape, a.layout)
        for k, a in kwargs.items():
            if type(a) is not _Tensor:
                return None
            parts += (k, a.shape, a.layout, a.device) if with_device else (k, a.shape, a.layout)
    except RuntimeError:  # a nested tensor has no shape to read: the rules name it
        return None
    return tuple(parts)


class _Walker:
    """One walk over a call's arguments, appending what the rules read to ``parts``."""

    __slots__ = ("dim", "parts", "with_device")

    def __init__(self, parts: list[Any], dim: int, with_device: bool) -> None:
        self.parts, self.dim, self.with_device = parts, dim, with_device

    def tensors(self, values: Iterable[Any]) -> None:
        """Exact tensors, in bulk (at C speed): their shapes, layouts and devices."""
        values = list(values)
        parts = self.parts
        parts.append(tuple(map(_SHAPE, values)))
        parts.append(frozenset(map(_LAYOUT, values)))
        if self.with_device:
            parts.append(tuple(map(_DEVICE, values)))

    def values(self, values: Iterable[Any], depth: int) -> None:
        """The children of one container, in order."""
        values = list(values)
        if values and set(map(type, values)) == {_Tensor}:  # the common case: plain tensors
            self.parts.append(_Tensor)
            self.tensors(values)
            return
        for value in values:
            self.one(value, depth)

    def one(self, obj: Any, depth: int) -> None:
        parts = self.parts
        cls = type(obj)
        if cls in ATOMS:
            parts.append(cls)
            return
        if isinstance(obj, _Tensor):
            parts.append(cls)
            self.tensors((obj,))
            return
        if depth > MAX_DEPTH:
            raise _Uncacheable
        if cls is dict:
            parts.append(dict)
            parts.append(tuple(obj))
            self.values(obj.values(), depth + 1)
        elif isinstance(obj, list):
            self.list(obj, depth)
        elif isinstance(obj, np.ndarray):
            parts.append((cls, obj.shape))
        elif cls is Shared:  # broadcast, whatever is inside
            parts.append(Shared)
        elif cls is Split:
            self.split(obj)
        elif isinstance(obj, PackedSequence):
            parts.append((cls, sequence_count(obj)))
        else:
            kind = container_kind(obj)
            parts.append(cls)
            if kind is None:  # any other object is broadcast as it is
                return
            keys, values = struct_items(obj, kind)
            if kind == MAPPING:
                parts.append(tuple(keys))
            parts.append(len(values))
            self.values(values, depth + 1)

    def list(self, obj: list[Any], depth: int) -> None:
        """A list: its kind (a tensor list, a sequence or structure) and what that kind's rule
        reads."""
        parts = self.parts
        parts.append(type(obj))
        parts.append(len(obj))
        if not obj:
            return
        types = item_types(obj)  # read once for the three questions below
        kind = list_kind(obj, self.dim, types)
        parts.append(kind)
        if kind == "structure":
            self.values(obj, depth + 1)
            return
        parts.append(frozenset(types))
        if kind == "tensorlist":  # one common size along dim, read from the first
            parts.append(obj[0].shape)
        elif holds_arrays(obj, types) is None:
            # items of other kinds (dicts, records): whether tensors lie inside is a rule's
            # question too (a broadcast sequence that holds tensors warns)
            parts.append(any(contains_array(x) or contains_record(x) for x in obj))

    def split(self, marker: Split[Any]) -> None:
        inner = marker.obj
        self.parts.append((Split, marker.dim, type(inner)))
        if isinstance(inner, (_Tensor, np.ndarray)):
            self.parts.append(inner.shape)
        else:
            self.parts.append(len(inner))
            self.parts.append(frozenset(map(type, inner)))


def _freeze(options: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The options as a comparable tuple, or ``None`` when a value cannot be compared cheaply
    and safely (an ndarray or a tensor of chunk sizes: such calls are not cached)."""
    out: list[Any] = []
    for k, v in options.items():
        if type(v) in _FROZEN:
            out.append((k, v))
        elif type(v) in (list, tuple) and all(type(x) in (int, float) for x in v):
            out.append((k, tuple(v)))
        else:
            return None
    return tuple(out)


class PlanCache:
    """One wrapper's plans, newest first, each kept as a template with the key it was built
    for (at most ``_MAX_PLANS``).

    Safe under concurrent calls: the list is replaced whole, and a hit makes a new ``Plan``
    (nothing kept is changed).
    """

    __slots__ = ("last", "plans", "warm")

    def __init__(self) -> None:
        self.plans: list[tuple[tuple[Any, ...], Plan]] = []
        # The wrapper's last warm call: (its key, its warm step, its kept plan, its steps);
        # ``()`` for the key before one (equal to no call's) (``dataparallel.wrapper._warm``
        # ``run_call``). Replaced whole.
        self.warm: tuple[Any, Any, Any, Any] = ((), None, None, None)
        # The last call's (options, dim, devices) as given (copies), and what a key holds of
        # them besides the signature (``None``: options not cached), and whether the devices are
        # one. While every option is an immutable value (None, a bool, an int, a dtype: no list
        # of chunk sizes that could be changed in place), equal values give the same, and
        # ``_freeze`` is skipped. Replaced whole (concurrent calls).
        self.last: tuple[Any, tuple[Any, ...] | None, bool] = (None, None, False)

    def get(
        self,
        inputs: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        devices: list[torch.device],
        dim: int,
        options: Mapping[str, Any],
    ) -> Plan:
        """The plan ``build_plan(inputs, kwargs, devices, dim, **options)`` would make."""
        plan = self.find(inputs, kwargs, devices, dim, options)
        return plan if plan.memo is None else plan.bind(inputs, kwargs)

    def find(
        self,
        inputs: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        devices: list[torch.device],
        dim: int,
        options: Mapping[str, Any],
    ) -> Plan:
        """The kept template for this call's signature (its ``memo`` is a dict; bind it to the
        call's arguments to run it), or, when none is kept, the plan built for this call (its
        ``memo`` is ``None``), kept for the next calls where it can be."""
        given, context, one_device = self.last
        if (options, dim, devices) != given:  # (a dict, an int, a list: compared in C)
            frozen = _freeze(options)
            immutable = frozen is not None and all(type(v) in _FROZEN for v in options.values())
            context = None if frozen is None else (frozen, dim, *devices)
            one_device = len(devices) == 1
            given = (dict(options), dim, list(devices)) if immutable else None
            self.last = (given, context, one_device)
        key = None
        if context is not None:
            if len(inputs) == 1 and not kwargs and type(a := inputs[0]) is _Tensor:
                # the most common call, keyed here as ``call_key`` keys it (no call made)
                try:
                    signature: Any = (
                        (a.shape, a.layout, a.device) if one_device else (a.shape, a.layout)
                    )
                except RuntimeError:  # a nested tensor has no shape to read: the rules name it
                    signature = None
            else:
                signature = call_key(inputs, kwargs, dim, one_device)
            if signature is not None:
                key = (signature, context)
                try:
                    for kept, template in self.plans:
                        if kept == key:
                            return template
                except Exception:  # a key that cannot be compared (a dict keyed by a tensor)
                    key = None
        plan = build_plan(inputs, kwargs, devices, dim, **options)
        if key is not None and not plan.per_call:
            if one_device and _moves_nothing(plan):
                plan.program.identity = True  # type: ignore[union-attr]
            template = plan.template(partial(build_plan, devices=devices, dim=dim, **options))
            self.plans = [(key, template), *self.plans[: _MAX_PLANS - 1]]
        return plan


def _moves_nothing(plan: Plan) -> bool:
    """Whether the plan's one chunk is the call's own arguments: the whole batch, no cast, every
    tensor already on that chunk's device (true of every call with the same key, which holds
    each tensor's device and shape)."""
    if len(plan.slices) != 1 or len(plan.slices[0]) != 1 or plan.dtype is not None:
        return False
    device, start, length = plan.slices[0][0]
    if start != 0 or length != plan.batch_size or type(plan.inputs) is not tuple:
        return False
    args, kw = take(plan, start, length, device)
    kwargs = plan.kwargs or {}
    return (
        len(args) == len(plan.inputs)
        and all(a is b for a, b in zip(args, plan.inputs, strict=True))
        and kw.keys() == kwargs.keys()
        and all(kw[k] is kwargs[k] for k in kw)
    )


# ----------------------------------------------------------------------------------------------
# The functional API's plans: one cache for the process, so its keys must hold no user object.

# The exact types a kept key may hold besides classes and ``call_key``'s own markers: none keeps
# a user's value alive, and none compares equal to a value of another of them (``True == 1 ==
# 1.0``, but ``{True: x}`` and ``{1: x}`` plan under different paths: bools and floats make a
# call uncacheable instead).
_INERT = frozenset((type(None), str, int, frozenset, torch.Size, torch.layout, torch.dtype))
_MARKERS = (_KWARGS, _NESTED)
# Option values kept as they are: their type is part of the key (``batch_size=True`` is refused
# where ``batch_size=1`` is not).
_OPTION_SCALARS = (type(None), bool, int, torch.dtype)
_REBUILT: dict[type, bool] = {}  # per class: a Mapping that is not a dict (see _inert)
_MAX_CLASSES = 4096


def _rebuilt_mapping(cls: type) -> bool:
    """Whether ``cls`` is a ``Mapping`` but not a ``dict`` (answered once per class)."""
    found = _REBUILT.get(cls)
    if found is None:
        if len(_REBUILT) >= _MAX_CLASSES:
            _REBUILT.clear()
        found = _REBUILT[cls] = issubclass(cls, Mapping) and not issubclass(cls, dict)
    return found


def _inert(parts: tuple[Any, ...]) -> bool:
    """Whether a call's key holds only classes, ``call_key``'s markers and ``_INERT`` values
    (strings, exact ints, shapes, layouts, dtypes and the sets ``call_key`` makes of types and
    layouts), in nested tuples.

    A class that is a ``Mapping`` but not a ``dict`` makes the call uncacheable too: the rules
    rebuild such a mapping from its values once, to name a class that cannot be rebuilt, and a
    reused plan would skip that.
    """
    for part in parts:
        cls = type(part)
        if cls is tuple:
            if not _inert(part):
                return False
        elif isinstance(part, type):
            if _rebuilt_mapping(part):
                return False
        elif cls is object:
            if part not in _MARKERS:  # identity first: a marker is found without __eq__
                return False
        elif cls not in _INERT:
            return False
    return True


def _option_key(options: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The options as a tuple that tells every value apart (``1``, ``1.0`` and ``True``; ``-0.0``
    and ``0.0`` by their ``repr``), or ``None`` for a value of any other kind (not cached)."""
    out: list[Any] = []
    for name, value in options.items():
        cls = type(value)
        if cls in _OPTION_SCALARS:
            out.append((name, cls, value))
        elif cls is float:
            out.append((name, cls, repr(value)))
        elif (cls is list or cls is tuple) and all(type(x) in (int, float) for x in value):
            out.append((name, cls, tuple(map(repr, value))))  # repr tells 1 from 1.0
        else:
            return None
    return tuple(out)


def _functional_key(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[torch.device],
    dim: Any,
    options: Mapping[str, Any],
) -> tuple[Any, ...] | None:
    """The key of a functional call, or ``None`` when it is planned afresh (not cached)."""
    if type(dim) is not int or not (kwargs is None or type(kwargs) is dict):
        return None
    frozen = _option_key(options)
    if frozen is None:
        return None
    is_tuple = type(inputs) is tuple
    signature = call_key(inputs if is_tuple else (inputs,), kwargs or {}, dim, False)
    if signature is None or not _inert(signature):
        return None
    return (signature, is_tuple, frozen, dim, *devices)


class CallPlans:
    """The plans of the functional ``scatter`` and ``scatter_kwargs``, newest first, each kept
    as a template with the key it was built for (at most ``_MAX_PLANS``).

    A training loop that calls ``dp.scatter`` on every step plans each batch of one signature
    once. What is kept holds no user value (``_inert``), so one instance can serve the process.
    A call whose key is not inert, or that raises while it is planned, is never kept: a kept
    plan was built without error for the same signature, and gives the same chunks and
    warnings. Safe under concurrent calls: the list is replaced whole, and a hit makes a new
    ``Plan`` (nothing kept is changed); two concurrent misses may keep only one of their plans.
    """

    __slots__ = ("plans",)

    def __init__(self) -> None:
        self.plans: list[tuple[tuple[Any, ...], Plan]] = []

    def get(
        self,
        inputs: Any,
        kwargs: Mapping[str, Any] | None,
        devices: list[torch.device],
        dim: int,
        options: Mapping[str, Any],
    ) -> Plan:
        """The plan ``build_plan(inputs, kwargs, devices, dim, allow_waves=False, **options)``
        would make."""
        key = _functional_key(inputs, kwargs, devices, dim, options)
        if key is not None:
            for kept, template in self.plans:
                if kept == key:
                    return template.bind(inputs, {} if kwargs is None else kwargs)
        plan = build_plan(inputs, kwargs, devices, dim, allow_waves=False, **options)
        if key is not None:
            # copies of the option lists (chunk_sizes, weights): the caller's stay theirs
            kept_options: dict[str, Any] = {
                k: list(v) if type(v) is list else v for k, v in options.items()
            }
            remake = partial(
                build_plan, devices=devices, dim=dim, allow_waves=False, **kept_options
            )
            self.plans = [(key, plan.template(remake)), *self.plans[: _MAX_PLANS - 1]]
        return plan
