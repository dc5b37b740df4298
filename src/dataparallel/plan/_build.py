"""The plan's entry points: ``plan`` (``dp.plan``) and ``build_plan``, the two passes in order.

``build_plan`` checks the options, runs pass 1 (``plan._votes``: the votes and the batch size
``B``) and pass 2 (``plan._rules``: every leaf's rule, compiled into the program), cuts ``B``
into chunk sizes (and waves under ``max_size``, ``plan._chunks``) and puts it all in a ``Plan``:
a readable record for ``explain`` and a compiled tree that ``dataparallel.scatter`` executes
for any slice of the batch. ``plan`` is the same for devices not yet resolved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dataparallel._common.checks import check_batch_size_used, dim_out_of_range
from dataparallel._common.describe import describe
from dataparallel._common.kinds import TUPLE
from dataparallel.devices import DeviceSpec, resolve_devices
from dataparallel.plan._chunks import cut_batch
from dataparallel.plan._explain import voters_phrase, warning_text
from dataparallel.plan._program import Plan, Program, Rebuild, Step
from dataparallel.plan._rules import Compiler
from dataparallel.plan._votes import Collector, decide_batch_size

__all__ = ["build_plan", "check_options", "plan"]

_OPTION_NAMES = ("batch_size", "chunk_sizes", "weights", "max_size", "dtype", "strict")


def check_options(opts: Mapping[str, Any]) -> None:
    """Refuse an option ``plan`` does not know (a typo would otherwise be ignored), naming the
    ones it does."""
    unknown = sorted(set(opts) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unexpected option(s) {unknown}; expected some of {list(_OPTION_NAMES)}")


def build_plan(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: list[torch.device],
    dim: int = 0,
    *,
    allow_waves: bool = True,
    **options: Any,
) -> Plan:
    """``plan`` for already resolved devices: what the wrapper, ``scatter`` and ``shard`` call.

    ``options`` are ``plan``'s (``batch_size``, ``chunk_sizes``, ``weights``, ``max_size``,
    ``dtype``, ``strict``); ``allow_waves=False`` refuses a batch that ``max_size`` would cut
    into more than one round (``scatter`` returns one).
    """
    check_options(options)
    batch_size: int | None = options.get("batch_size")
    chunk_sizes: Sequence[int] | None = options.get("chunk_sizes")
    weights: Sequence[float] | None = options.get("weights")
    max_size: int | None = options.get("max_size")
    dtype: torch.dtype | None = options.get("dtype")
    strict = options.get("strict", False)
    if not isinstance(strict, (bool, np.bool_)):
        # bool("no") is True: a truthy string or number must not switch strict mode on
        raise TypeError(
            f"strict: expected True or False, got {strict!r}; pass strict=True to make an "
            f"input of another size than the batch an error, strict=False (the default) to "
            f"broadcast it with a warning"
        )
    strict = bool(strict)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs: expected a dict of keyword arguments, got {describe(kwargs)}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int (the batch dimension), got {dim!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype such as torch.float16, got {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(
            f"dtype: expected a floating-point dtype such as torch.float16 (it casts float "
            f"inputs; integer and boolean ones keep their type), got {dtype}; cast integer "
            f"inputs yourself before the call"
        )
    collector = Collector(dim)
    is_tuple = type(inputs) is tuple
    if is_tuple:
        arg_infos = [collector.visit(a, f"args[{i}]") for i, a in enumerate(inputs)]
    else:
        arg_info = collector.visit(inputs, "input")
    kw_keys = list(kwargs.keys())
    kw_infos = [collector.visit(kwargs[k], f"kwargs[{k!r}]") for k in kw_keys]

    if not collector.votes and collector.max_ndim > 0 and collector.first_split is None:
        raise dim_out_of_range(dim, collector.max_ndim)
    batch, how, lost_ties = decide_batch_size(collector.votes, collector.first_split, batch_size)

    def voters() -> str:
        return voters_phrase(batch, how, collector.votes)

    compiler = Compiler(batch, dim, voters, strict, cast=dtype is not None, lost_ties=lost_ties)
    if is_tuple:
        root_args: Step = Rebuild("args", TUPLE, [compiler.compile(i) for i in arg_infos])
    else:
        root_args = compiler.compile(arg_info)
    program = Program(root_args, is_tuple, kw_keys, [compiler.compile(i) for i in kw_infos])

    if batch_size is not None and batch > 1 and compiler.entries:
        check_batch_size_used(batch, compiler.entries)
    if batch == 0:
        # An empty batch runs the module once, on the first device, as the plain module would
        # (torch's DataParallel does the same); there are no samples to cut, so the chunk
        # options do not apply.
        waves = [[0] * len(devices)]
    else:
        waves = cut_batch(
            batch,
            len(devices),
            chunk_sizes=chunk_sizes,
            weights=weights,
            max_size=max_size,
            allow_waves=allow_waves,
        )
    chunks = sum(1 for wave in waves for size in wave if size)
    if collector.iterators and chunks > 1:
        raise ValueError(
            f"{', '.join(collector.iterators)}: an iterator or generator, expected a value that "
            f"{chunks} chunks can share: the first replica to read it would consume it and the "
            f"others would see nothing; pass list(...) instead (split per sample when it has "
            f"the batch size, else broadcast)"
        )
    slices: list[list[tuple[torch.device, int, int]]] = []
    start = 0
    totals = [0] * len(devices)
    for wave in waves:
        cut = []
        for index, size in enumerate(wave):
            if size:
                cut.append((devices[index], start, size))
                start += size
                totals[index] += size
        slices.append(cut)
    used = [i for i, total in enumerate(totals) if total]
    if batch == 0:
        slices, used = [[(devices[0], 0, 0)]], [0]
    warnings = list(compiler.notes)
    if compiler.mismatched:
        warnings.insert(0, warning_text(batch, how, voters(), collector.votes, compiler.mismatched))
    return Plan(
        batch_size=batch,
        devices=[devices[i] for i in used],
        chunk_sizes=[totals[i] for i in used],
        leaf_rules=compiler.entries,
        votes=collector.votes,
        waves=[[s for s in wave if s] for wave in waves] if batch else [[0]],
        device_sizes=waves,
        decided_by=how,
        dim=dim,
        warnings=warnings,
        dtype=dtype,
        program=program,
        inputs=inputs,
        kwargs=kwargs,
        slices=slices,
        per_call=compiler.per_call,
        warning_key=tuple(path for path, _ in compiler.mismatched)
        + tuple(note.split(":", 1)[0] for note in compiler.notes),
    )


def plan(
    inputs: Any,
    kwargs: Mapping[str, Any] | None = None,
    devices: DeviceSpec | Sequence[DeviceSpec] | None = None,
    dim: int = 0,
    **opts: Any,
) -> Plan:
    """Decide how a call's arguments are split over ``devices``; runs nothing.

    Args:
        inputs: the positional arguments as a ``tuple``; anything else is one argument.
        kwargs: the keyword arguments (a dict), or ``None``.
        devices: a device list such as ``["cpu", "cpu"]`` or ``[0, 1]``; ``None`` means every
            visible CUDA device, else the CPU.
        dim: the batch dimension of tensors and ndarrays.
        **opts: the batch options: ``batch_size`` (int: the batch size, not voted),
            ``chunk_sizes`` (list of int, one per device), ``weights`` (list of float: the
            devices' shares), ``max_size`` (int: the most samples per chunk, in waves),
            ``dtype`` (floating tensors cast on the way), ``strict`` (bool: refuse any
            argument the rules broadcast); the guide's "The batch rules, in short".

    Returns:
        A ``Plan``; ``str(plan)`` is a readable table of the votes and of each leaf's rule.

    Raises:
        TypeError: an unknown option.
        ValueError: a bad device spec or option value (``chunk_sizes`` that do not sum to the
            batch size...); a ``Split`` whose size is not the batch size; under ``strict``, an
            argument the rules would broadcast. Each message names the argument and the fix.

    Example:
        >>> import torch, dataparallel as dp
        >>> p = dp.plan((torch.zeros(10, 3), torch.zeros(1, 4)), None, ["cpu", "cpu"])
        >>> p.batch_size, p.chunk_sizes, [e.rule for e in p.entries]
        (10, [5, 5], ['split', 'broadcast'])
    """
    check_options(opts)
    return build_plan(inputs, kwargs, resolve_devices(devices), dim, **opts)
