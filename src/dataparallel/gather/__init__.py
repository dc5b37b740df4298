"""Gather: the replicas' outputs as one, on the output device, in batch order.

``_gather`` walks the outputs under the gather rules; beside it, one job each: scalars and
counts (``_scalars``), values the replicas received rather than computed (``_origins``), paths,
moves and equality of outputs (``_outputs``), ``output_rules=`` (``_output_rules``), and how a
loss is gathered (``_loss``: a loss re-formed from how forward built it, outputs computed from
``num_items_in_batch``, ``DataParallelCriterion``'s parts, ``scalar_weights=``).

Other folders import this stage through this module, never its private modules: ``__all__``
is its interface (``dataparallel`` re-exports the public names).
"""

from __future__ import annotations

from dataparallel.gather._gather import (
    ScalarMode,
    check_scalars,
    concat_batched,
    first_batch_size,
    gather,
    gather_outputs,
)
from dataparallel.gather._loss import (
    COUNT_KEYWORD,
    NO_TARGET,
    Record,
    ScalarWeights,
    SumAndCount,
    chunk_weights,
    combine,
    is_exact_mean,
    mark_inputs,
    marks_plain,
    said_note,
    summing_note,
    terms_note,
    unmark,
    unmark_inputs,
)
from dataparallel.gather._origins import Origins
from dataparallel.gather._output_rules import check_output_rules

__all__ = [
    "COUNT_KEYWORD",
    "NO_TARGET",
    "Origins",
    "Record",
    "ScalarMode",
    "ScalarWeights",
    "SumAndCount",
    "check_output_rules",
    "check_scalars",
    "chunk_weights",
    "combine",
    "concat_batched",
    "first_batch_size",
    "gather",
    "gather_outputs",
    "is_exact_mean",
    "mark_inputs",
    "marks_plain",
    "said_note",
    "summing_note",
    "terms_note",
    "unmark",
    "unmark_inputs",
]
