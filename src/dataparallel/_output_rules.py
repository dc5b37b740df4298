"""The gather rules that shapes and values alone cannot always settle, and the user's word on them.

Two kinds of outputs look alike across replicas while meaning different things:

- an RNN's hidden state ``h_n``/``c_n`` has its batch on dim 1, ``(layers*directions, batch,
  hidden)``. Where its dim 0 is the same on every replica and its dim 1 is each replica's chunk
  size, it is told apart from a batched output; on an even split whose chunk size equals
  ``layers*directions`` both readings fit, and the module's own RNN layers (``nn.RNNBase``)
  settle it: a tensor of an RNN state's shape is a state;
- an integer scalar may be a count (``int(x.shape[0])``, ``(x > 0).sum()``: one device returns
  the sum over the chunks) or a constant (``num_classes``: one device returns it once).

``output_rules={path: rule}`` says it outright for one output, by the path the messages print
(``"output[1][0]"``, ``"output['n']"``, ``"output.logits"``): an int is the output's batch
dimension (concatenated along it), ``"sum"``, ``"mean"`` or ``"stack"`` reduce it across
replicas, ``"all"`` and ``"any"`` reduce booleans (elementwise for tensors), ``"same"`` keeps one
copy (the replicas must agree), ``"list"`` keeps one per replica.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from torch import nn

from dataparallel._warn import warn_user

__all__ = [
    "RULE_NAMES",
    "check_output_rules",
    "rnn_state_shapes",
    "warn_even_count",
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
