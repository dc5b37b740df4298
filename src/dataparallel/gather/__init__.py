"""Gather: the replicas' outputs as one, on the output device, in batch order.

``_gather`` walks the outputs under the gather rules; beside it, one job each: scalars and
counts (``_scalars``), values the replicas received rather than computed (``_origins``), paths,
moves and equality of outputs (``_outputs``), ``output_rules=`` (``_output_rules``) and exact
token means (``_losses``: ``scalar_weights=`` and ``DataParallelCriterion``'s parts).
"""

from __future__ import annotations

from dataparallel.gather._gather import (
    ScalarMode,
    check_scalars,
    first_batch_size,
    gather,
    gather_outputs,
)

__all__ = ["ScalarMode", "check_scalars", "first_batch_size", "gather", "gather_outputs"]
