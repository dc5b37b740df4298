"""Gather: the replicas' outputs -> one output, in batch order, on the target device.

``torch.nn.DataParallel`` concatenates every tensor it finds, turns 0-dim losses into a vector
and fails on strings, dataclasses and lists of boxes. ``gather`` reads each output by what it
is, under the guide's "The gather rules, in short": batched tensors are concatenated, losses
averaged by chunk size, per-sample lists joined, structures rebuilt with their own type, and
everything else kept once when the replicas agree.

This module holds the entry points and what one gather call needs (``_Context``); the walk
over the outputs, rule by rule, is ``_walk``'s. With one replica, a gather is a plain walk that
moves tensors to the target device and rebuilds only containers whose contents moved.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn

from dataparallel._common.checks import (
    check_gather_sizes,
    check_scalar_weights,
)
from dataparallel._common.kinds import (
    ARRAY,
    TENSOR,
    kind_of,
)
from dataparallel._common.tree import TooDeep, leaves
from dataparallel.devices import DeviceSpec
from dataparallel.devices import target_device as resolve_target
from dataparallel.gather._output_rules import (
    check_output_rules,
    rnn_state_shapes,
    warn_squeezed,
    warn_unmatched,
)
from dataparallel.gather._outputs import (
    to_target,
)
from dataparallel.gather._walk import walk

__all__ = [
    "ScalarMode",
    "check_scalars",
    "concat_batched",
    "first_batch_size",
    "gather",
    "gather_outputs",
]

ScalarMode = Literal["mean", "sum", "stack"]
_Tensor = torch.Tensor
_CPU = torch.device("cpu")  # equal only to device(type='cpu'), a CPU tensor's device
_SCALAR_MODES = ("mean", "sum", "stack")


class _Context:
    """What every step of one gather needs; built once per call."""

    __slots__ = (
        "count",
        "counts",
        "dim",
        "module",
        "origins",
        "roles",
        "rules",
        "said",
        "scalars",
        "seen",
        "sizes",
        "squeezed",
        "states",
        "target",
        "warned",
        "weigh",
        "weighed",
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
        weigh: Callable[[], Sequence[float] | None] | None = None,
    ) -> None:
        self.target = target
        self.dim = dim
        self.sizes = sizes
        self.scalars = scalars
        # Unknown sizes (or all zero) weigh every replica alike.
        self.counts: tuple[float, ...] = sizes if sizes is not None and sum(sizes) > 0 else (1,) * n
        if scalar_weights is not None and sum(scalar_weights) > 0:
            self.counts = scalar_weights  # e.g. each chunk's count of labelled tokens
        self.weights = tuple(c / sum(self.counts) for c in self.counts)
        # The wrapper's scalar_weights, called only when a mean needs them (``_loss._rule``),
        # and what they gave
        self.weigh = weigh
        self.weighed: tuple[float, ...] | None = None
        self.rules: dict[str, int | str] | None = None  # output_rules, by formatted path
        self.seen: list[str] = []  # the paths walked, when rules are given (for a typo)
        self.module: nn.Module | None = None
        self.origins: Any = None  # a _origins.Origins: which scalars each replica received
        # a _loss.Record when the call passed num_items_in_batch to its replicas
        self.count: Any = None
        # Paths where an RNN layer puts its output ("sequence") and state ("state"): the items
        # of a pair (tensor, state), state a tensor or a pair (h_n, c_n). Made on first need.
        self.roles: dict[Any, str] | None = None
        self.states: frozenset[tuple[int, int]] | None = None  # read from module when needed
        # The keys of warnings already given by this wrapper (its ``_warned``), so that a
        # warning the walk gives shows once per wrapper; None: Python's filter decides.
        self.warned: set[tuple[str, ...]] | None = None
        # (path, rule) of 0-dim outputs of 1-sample chunks: a loss or a squeezed per-sample
        # output, which no rule can tell apart (one warning per call, after the walk)
        self.squeezed: list[tuple[str, str]] = []
        # The wrapper's record of how each scalar output was gathered, by path (``explain``
        # says it); None: not kept
        self.said: dict[Any, str] | None = None

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
        TypeError: ``outputs`` is not a list of per-replica outputs.
        ValueError: a bad argument, replicas that disagree on structure, or tensors that can
            neither be told equal nor concatenated. The message names the output path.

    Example:
        >>> import torch, dataparallel as dp
        >>> parts = [{"y": torch.ones(2, 3), "loss": torch.tensor(1.0), "n": 10},
        ...          {"y": torch.zeros(1, 3), "loss": torch.tensor(4.0), "n": 10}]
        >>> out = dp.gather(parts, "cpu")
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
    warned: set[tuple[str, ...]] | None = None,
    count: Any = None,
    weigh: Callable[[], Sequence[float] | None] | None = None,
    said: dict[Any, str] | None = None,
) -> Any:
    """The pipeline's gather: ``gather`` for arguments already checked (``DataParallel``
    checks them once, at construction), with the cheapest rule that applies chosen here, not by
    the caller.

    One replica's output comes back as the module gave it (tensors moved to ``target``) unless
    ``"stack"`` or ``output_rules`` ask for more; outputs that are all plain tensors batched
    along ``dim`` are concatenated (rule 1); anything else takes the rules' walk. ``sizes`` is
    ``None`` when the chunk sizes are not known (read from the outputs then). ``origins`` (a
    ``dataparallel.gather._origins.Origins``) tells a buffer or input each replica received from a
    value it computed, for scalars that are not one object on every replica. ``warned`` is the
    wrapper's set of warnings already given, so that the walk's warnings show once per wrapper.
    ``count`` (a ``dataparallel.gather._loss.Record``) is the call's when each replica
    received a marked ``num_items_in_batch``: outputs computed from it are summed (``_loss``).
    ``weigh`` (no ``scalar_weights`` given) returns each replica's weight in a ``"mean"``, read
    only when a mean needs it: the wrapper's ``scalar_weights``. ``said`` (the wrapper's) gets,
    by output path, how each floating scalar was gathered, which ``explain`` then says.
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
            out = concat_batched(outputs, target, dim, sizes)
            if out is not None:
                return out
        weights = (
            None if scalar_weights is None else check_scalar_weights(scalar_weights, len(outputs))
        )
        ctx = _Context(
            target,
            dim,
            None if sizes is None else tuple(sizes),
            scalars,
            len(outputs),
            weights,
            None if weights is not None else weigh,
        )
        ctx.module, ctx.rules = module, dict(output_rules) if output_rules else None
        ctx.origins, ctx.warned = origins, warned
        ctx.count, ctx.said = count, said
        out = walk(outputs, None, ctx)
        if ctx.squeezed:
            _warn_squeezed(ctx)
        if ctx.rules:
            warn_unmatched(ctx.rules, ctx.seen)
        return out
    except (RecursionError, TooDeep):
        pass  # raised below, outside the handler, so the message is not chained to it
    raise _too_deep()


def _warn_squeezed(ctx: _Context) -> None:
    """One warning for the call's 0-dim outputs of 1-sample chunks, once per wrapper (its
    ``_warned`` set) for the same paths, or once per place under Python's filter."""
    key = ("squeezed-scalars", *(where for where, _ in ctx.squeezed))
    if ctx.warned is not None:
        if key in ctx.warned:
            return
        ctx.warned.add(key)
    warn_squeezed(ctx.squeezed, cast(tuple[int, ...], ctx.sizes))


def _too_deep() -> ValueError:
    return ValueError(
        "outputs: nested deeper than Python's recursion limit, or a container that contains "
        "itself, expected a tree of tuples, lists, dicts and dataclasses; return a flatter "
        "output, or use gather=False"
    )


def concat_batched(
    outputs: Sequence[Any], target: torch.device, dim: int, sizes: Sequence[int]
) -> torch.Tensor | None:
    """``gather(outputs, target, dim, chunk_sizes=sizes)`` when every output is a plain tensor
    whose size along ``dim`` is its chunk's (rule 1: concatenated on ``target``), for arguments
    already checked; ``None`` when another rule may apply (the caller then calls ``gather``):
    an output that is not a plain tensor of its chunk's size along ``dim``, or is also shaped
    like an RNN state (gather's rule decides).

    One frame for every output (a warm call runs this on every call): each output's checks are
    written out in the loop, not in a function per output."""
    cpu = target == _CPU  # a CPU tensor's device is the plain CPU: a flag, not an object to build
    moves = False
    for v, size in zip(outputs, sizes, strict=True):
        if type(v) is not _Tensor:
            return None
        shape = v.shape  # (read once: each read builds a torch.Size)
        try:
            if shape[dim] != size:
                return None
        except IndexError:  # ``dim`` out of range for this output
            return None
        if len(shape) == 3 and dim == 0 and shape[1] == size:  # (most outputs: one test)
            return None  # an RNN state's shape too: gather's rule decides
        if not (v.is_cpu if cpu else v.device == target):
            moves = True
    try:
        if moves:
            return torch.cat([v if v.device == target else v.to(target) for v in outputs], dim)
        return torch.cat(outputs, dim)  # type: ignore[arg-type]  # (all plain tensors, above)
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
