"""The gather rules that shapes and values alone cannot always settle, and the user's word on them.

Two kinds of outputs look alike across replicas while meaning different things:

- an RNN's hidden state ``h_n``/``c_n`` has its batch on dim 1, ``(layers*directions, batch,
  hidden)``. Where its dim 0 is the same on every replica and its dim 1 is each replica's chunk
  size, it is told apart from a batched output. On an even split whose chunk size equals
  ``layers*directions`` both readings fit: a tensor of the shape of one of the module's RNN
  states (``nn.RNNBase``) is a state where an RNN returns one (the second item of a pair whose
  first is a 3-d tensor, or an item of the pair there: ``(output, (h_n, c_n))``); anywhere else
  (a ``Linear`` after a batch-first GRU) it is batched on dim 0, torch's reading, with a
  warning naming the path and the ``output_rules`` fix; so is any 3-d output whose dims 0 and 1
  both equal the chunk size (a time-major ``(T, batch, C)`` with ``T`` the chunk size, CRNN's),
  with a warning;
- an integer scalar may be a count (``int(x.shape[0])``, ``(x > 0).sum()``: one device returns
  the sum over the chunks) or a constant (``num_classes``: one device returns it once).

``output_rules={path: rule}`` says it outright for one output, by the path the messages print
(``"output[1][0]"``, ``"output['n']"``, ``"output['logits']"``; a model-output class's field
as an attribute too, ``"output.logits"``): an int is the output's batch
dimension (concatenated along it), ``"sum"``, ``"mean"`` or ``"stack"`` reduce it across
replicas, ``"all"`` and ``"any"`` reduce booleans (elementwise for tensors), ``"same"`` keeps one
copy (the replicas must agree), ``"list"`` keeps one per replica.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from dataparallel._common.warn import warn_user
from dataparallel.gather._outputs import all_equal, arrays_equal, fmt, sum_all, to_target

__all__ = [
    "RULE_NAMES",
    "apply_rule",
    "check_chunk_matrix",
    "check_output_rules",
    "hidden_state",
    "note_roles",
    "rnn_state_shapes",
    "warn_even_count",
    "warn_squeezed",
    "warn_unmatched",
]

RULE_NAMES = ("sum", "mean", "stack", "same", "list", "all", "any")


def check_output_rules(rules: Any) -> dict[str, int | str] | None:
    """``output_rules`` validated: a dict of output paths to an int dim or a rule name."""
    if rules is None:
        return None
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"output_rules: expected a dict of output paths to rules, got "
            f"{type(rules).__name__}; pass e.g. {{'output[1][0]': 1}} (batch on dim 1) or "
            f"{{\"output['n']\": 'sum'}}"
        )
    checked: dict[str, int | str] = {}
    for path, rule in rules.items():
        if not isinstance(path, str) or not path.startswith("output"):
            raise ValueError(
                f"output_rules: expected keys that are output paths as the messages print them "
                f"(starting with 'output', such as 'output[0]' or \"output['loss']\"), got "
                f"{path!r}"
            )
        if isinstance(rule, bool) or not (
            hasattr(rule, "__index__") or (isinstance(rule, str) and rule in RULE_NAMES)
        ):
            raise ValueError(
                f"output_rules[{path!r}]: expected an int (the output's batch dimension) or one "
                f"of {list(RULE_NAMES)}, got {rule!r}"
            )
        checked[path] = rule if isinstance(rule, str) else operator.index(rule)
    return checked


def rnn_state_shapes(module: nn.Module | None) -> frozenset[tuple[int, int]]:
    """``(layers*directions, size)`` of every hidden state the module's RNN layers return:
    ``h_n`` has ``proj_size`` (or ``hidden_size``) features, ``c_n`` ``hidden_size``."""
    if module is None:
        return frozenset()
    shapes: set[tuple[int, int]] = set()
    for sub in module.modules():
        if isinstance(sub, nn.RNNBase):
            lead = sub.num_layers * (2 if sub.bidirectional else 1)
            shapes.add((lead, sub.hidden_size))
            if getattr(sub, "proj_size", 0):
                shapes.add((lead, sub.proj_size))
    return frozenset(shapes)


def warn_even_count(where: str, value: Any, size: int, total: int) -> None:
    """The one case the integer rule cannot tell: every replica returned its chunk size on an
    even split, which is also what a constant equal to the chunk size looks like."""
    warn_user(
        f"{where}: every replica returned {value!r}, its chunk size ({size}), so it is read as "
        f"a count of the chunk's samples (int(x.shape[0])) and summed to {total}, what one "
        f"device returns; on an even split a constant equal to the chunk size looks the same. "
        f"If it is a constant, pass output_rules={{{where!r}: 'same'}}; if it is a count, "
        f"output_rules={{{where!r}: 'sum'}} says so and silences this"
    )


def warn_squeezed(found: list[tuple[str, str]], sizes: tuple[int, ...]) -> None:
    """The case the scalar rule cannot tell: every replica returned a 0-dim value from a
    1-sample chunk, at each path of ``found`` (with the reduction it got, ``"mean"`` or
    ``"sum"``). A per-chunk loss looks like that, and so does a per-sample output whose batch
    dimension ``squeeze()`` removed (``nn.Linear(h, 1)(x).squeeze()`` on a last batch of 2 on
    two devices), which one device returns as a vector of the batch size. One warning for all
    the paths of a call."""
    n = len(sizes)
    paths = ", ".join(where for where, _ in found)
    first = found[0][0]
    silence = {where: rule for where, rule in found}
    warn_user(
        f"{paths}: every replica returned a 0-dim value from a 1-sample chunk (chunk sizes "
        f"{list(sizes)}), so it is read as a per-chunk scalar (a loss, a count) and reduced to "
        f"one value (a float averaged, chunk-weighted; an integer summed). A per-sample output "
        f"that lost its batch dimension looks the same: nn.Linear(h, 1)(x).squeeze() on a batch "
        f"of {n} in {n} one-sample chunks, where one device returns shape ({n},). If it is "
        f"per-sample, keep the batch dimension (squeeze(-1)) or pass "
        f"output_rules={{{first!r}: 'stack'}} (one value per sample, in batch order); if it is a "
        f"per-chunk scalar, output_rules={silence!r} says so and silences this"
    )


def warn_unmatched(rules: Mapping[str, Any], seen: list[str]) -> None:
    """A path in ``output_rules`` that no output has is most likely a typo: say which."""
    missing = [p for p in rules if p not in seen]
    if missing:
        listing = ", ".join(seen[:8]) + (", ..." if len(seen) > 8 else "")
        warn_user(
            f"output_rules: {missing!r} matched no output of this call (its outputs: "
            f"{listing}); expected paths as the gather messages print them, such as "
            f"'output[1][0]' or \"output['loss']\""
        )


# ------------------------------------------------------------------ output_rules applied


def apply_rule(
    values: list[Any], where: str, rule: int | str, ctx: Any, concat: Callable[..., Any]
) -> Any:
    """What ``output_rules`` says for one output, in place of the rules; ``ctx`` is gather's
    context, ``concat(values, path, dim, ctx, where)`` its concatenation."""
    if rule == "list":
        return [to_target(v, ctx.target, None) for v in values]
    if rule == "same":
        moved = [to_target(v, ctx.target, None) for v in values]
        arrays = all(isinstance(v, (torch.Tensor, np.ndarray)) for v in moved)
        if (arrays_equal if arrays else all_equal)(moved):
            return moved[0]
        raise ValueError(
            f"{where}: output_rules says 'same', but the replicas returned different values "
            f"({', '.join(f'replica {i}: {v!r:.40}' for i, v in enumerate(values))}); expected "
            f"one value on every replica. Use 'sum', 'mean', 'list' or a batch dimension instead"
        )
    if isinstance(rule, int):
        if not all(isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim > 0 for v in values):
            raise ValueError(
                f"{where}: output_rules gives batch dimension {rule}, but the replicas returned "
                f"{[type(v).__name__ for v in values]}; expected tensors or ndarrays with a "
                f"dimension {rule}. Give a rule name ('sum', 'mean', 'same', 'list') instead"
            )
        return concat(values, None, rule, ctx, where)
    if rule == "stack":
        return torch.stack([torch.as_tensor(v, device=ctx.target) for v in values])
    moved = [to_target(v, ctx.target, None) for v in values]
    if rule in ("all", "any"):
        return _reduce_booleans(moved, where, rule)
    _check_same_shapes(moved, where, rule)
    if rule == "sum":
        return sum_all(moved)
    # "mean": chunk-weighted (numbers, tensors elementwise), as scalars="mean" weighs losses
    return sum_all([v * w for v, w in zip(moved, ctx.weights, strict=True) if w])


def _reduce_booleans(values: list[Any], where: str, rule: str) -> Any:
    """``output_rules``' ``"all"`` and ``"any"``: Python's for bools, elementwise for tensors
    and ndarrays of one shape (a 0-dim bool tensor stays one)."""
    if all(isinstance(v, torch.Tensor) for v in values):
        _check_same_shapes(values, where, rule)
        stacked = torch.stack([v.bool() for v in values])
        return stacked.all(0) if rule == "all" else stacked.any(0)
    if all(isinstance(v, np.ndarray) for v in values):
        _check_same_shapes(values, where, rule)
        return np.all(values, axis=0) if rule == "all" else np.any(values, axis=0)
    if any(isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim > 0 for v in values):
        raise ValueError(
            f"{where}: output_rules says {rule!r}, but the replicas returned "
            f"{[type(v).__name__ for v in values]}; expected booleans, or tensors or ndarrays "
            f"of one shape. Return one kind on every replica"
        )
    found = [bool(v) for v in values]
    return all(found) if rule == "all" else any(found)


def _check_same_shapes(values: list[Any], where: str, rule: str) -> None:
    """A reduction across replicas needs one shape: broadcasting ``(1, 5)`` with ``(1, 2, 5)``
    would make a value no device returned."""
    shapes = [tuple(v.shape) for v in values if isinstance(v, (torch.Tensor, np.ndarray))]
    if len(set(shapes)) > 1:
        listing = ", ".join(
            f"replica {i} has shape {tuple(v.shape)}"
            for i, v in enumerate(values)
            if isinstance(v, (torch.Tensor, np.ndarray))
        )
        raise ValueError(
            f"{where}: output_rules says {rule!r}, but the replicas' shapes differ: {listing}; "
            f"expected one shape on every replica (nothing is broadcast). Return the same "
            f"shape on every replica, or give the output's batch dimension (an int) or 'list'"
        )


# --------------------------------------------------------------- RNN states by position


def hidden_state(values: list[Any], path: Any, ctx: Any) -> bool:
    """Whether 3-d outputs are an RNN state, batch on dim 1: dim 0 the same on every replica,
    dim 1 each replica's chunk size, and either the shape of one of the module's RNN states,
    or (no RNN says so) not also batched on dim 0 and not equal on every replica (a constant).

    Where dim 0 is each replica's chunk size too (an even split whose chunk size is
    ``layers*directions``), both readings fit the shapes. An output where an RNN layer returns
    its state (``note_roles``) of a state's shape is a state; any other is batched on dim 0,
    torch's reading, with a warning when it has a state's shape (a ``Linear`` after a
    batch-first GRU)."""
    first = values[0]
    if first.ndim != 3:
        return False
    lead = first.shape[0]
    for v, size in zip(values, ctx.sizes, strict=True):
        if v.ndim != 3 or v.shape[0] != lead or v.shape[1] != size:
            return False
    state_shape = (lead, first.shape[2]) in ctx.state_shapes()
    if not all(lead == size for size in ctx.sizes):
        return state_shape or not arrays_equal(values)  # dim 0 is not batched: decided
    if not state_shape:
        # an even split of chunks of `lead`: torch's reading, batch on dim 0, said where a
        # time-major output (T, batch, C) with T the chunk size fits as well (CRNN's)
        if lead > 1 and not arrays_equal(values):
            _warn_time_major(values, path, ctx)
        return False
    role = None if ctx.roles is None else ctx.roles.get(path)
    if role == "state":
        return True
    if role != "sequence":
        _warn_tie(values, path, ctx)
    return False


def _warn_tie(values: list[Any], path: Any, ctx: Any) -> None:
    where = fmt(path)
    shape = tuple(values[0].shape)
    total = (sum(ctx.sizes), *shape[1:])
    warn_user(
        f"{where}: every replica returned shape {shape}, whose dims 0 and 1 both equal the "
        f"chunk size ({shape[0]}), and which is also the shape of the module's RNN hidden "
        f"state (layers*directions, batch, hidden); read it as batched on dim 0, as torch "
        f"does, giving {total}. If it is an RNN state (batch on dim 1), pass "
        f"output_rules={{{where!r}: 1}}; output_rules={{{where!r}: 0}} says it is batched on "
        f"dim 0 and silences this"
    )


def _warn_time_major(values: list[Any], path: Any, ctx: Any) -> None:
    where = fmt(path)
    shape = tuple(values[0].shape)
    total = sum(ctx.sizes)
    warn_user(
        f"{where}: every replica returned shape {shape}, whose dims 0 and 1 both equal the "
        f"chunk size ({shape[0]}): read as batched on dim 0, as torch does, giving "
        f"{(total, *shape[1:])}; a time-major output (T, batch, C), such as CRNN's, is "
        f"batched on dim 1 and gives {(shape[0], total, shape[2])}. If its batch is on dim 1, "
        f"pass output_rules={{{where!r}: 1}} (or take the per-device outputs with "
        f"gather=False); output_rules={{{where!r}: 0}} says it is batched on dim 0 and "
        f"silences this"
    )


def note_roles(first: tuple[Any, ...], path: Any, ctx: Any) -> None:
    """Record where an RNN layer's return puts its output and its state: in a pair whose first
    item is a tensor, the second is a state, or a pair of states (an LSTM's ``(h_n, c_n)``)."""
    roles = ctx.roles
    if roles is None:
        if not (isinstance(first[0], torch.Tensor) and first[0].ndim == 3):
            return  # no RNN output here, and no state around it
        roles = ctx.roles = {}
    if roles.get(path) == "state":  # (h_n, c_n)
        roles[(path, "[", 0)] = roles[(path, "[", 1)] = "state"
    elif isinstance(first[0], torch.Tensor) and first[0].ndim == 3:
        roles[(path, "[", 0)], roles[(path, "[", 1)] = "sequence", "state"


def check_chunk_matrix(values: list[Any], where: str, sizes: tuple[int, ...]) -> None:
    """Square matrices over each chunk's own samples, of chunks that differ in size: a
    similarity ``a @ b.t()`` computed inside forward (CLIP's logits). Each replica sees only
    its chunk, so the blocks leave out every pair of samples on different devices and cannot
    even be joined: refused, naming the port that works. Chunks of one size give blocks of one
    shape, which no rule tells from a per-sample output whose features number the chunk size
    (the guide says so)."""
    if len(set(sizes)) < 2 or not all(
        v.ndim == 2 and v.shape[0] == v.shape[1] == n for v, n in zip(values, sizes, strict=True)
    ):
        return
    total = sum(sizes)
    raise ValueError(
        f"{where}: every replica returned a square matrix over its own chunk's samples "
        f"(shapes {[tuple(v.shape) for v in values]} for chunk sizes {list(sizes)}), as a "
        f"similarity a @ b.t() computed inside forward does; one device returns ({total}, "
        f"{total}), and the chunks' blocks leave out every pair of samples on different "
        f"devices. To port it, compute the matrix outside the wrapper: return its factors (the "
        f"batched embeddings) and take a @ b.t() on the gathered ones, which is one device's "
        f"({total}, {total}) matrix and its gradients"
    )
