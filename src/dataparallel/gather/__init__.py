"""Gather: the replicas' outputs as one, on the output device, in batch order.

``_gather`` walks the outputs under the gather rules; beside it, one job each: scalars and
counts (``_scalars``), values the replicas received rather than computed (``_origins``), paths,
moves and equality of outputs (``_outputs``), outputs computed from
``num_items_in_batch`` (``_counted``), ``output_rules=`` (``_output_rules``), losses re-formed
from how forward built them (``_terms``) and ``DataParallelCriterion``'s parts (``_losses``).

Other folders import this stage through this module, never its private modules: ``__all__``
is its interface (``dataparallel`` re-exports the public names).
"""

from __future__ import annotations

from dataparallel.gather._counted import COUNT_KEYWORD, CountRecord, is_counted, unmark
from dataparallel.gather._gather import (
    ScalarMode,
    batched_part,
    check_scalars,
    concat_batched,
    first_batch_size,
    gather,
    gather_outputs,
)
from dataparallel.gather._losses import (
    ScalarWeights,
    SumAndCount,
    chunk_weights,
    combine,
    is_exact_mean,
)
from dataparallel.gather._origins import Origins
from dataparallel.gather._output_rules import check_output_rules
from dataparallel.gather._terms import (
    is_marked,
    mark_inputs,
    marks_plain,
    terms_note,
    unmark_inputs,
)

__all__ = [
    "COUNT_KEYWORD",
    "CountRecord",
    "Origins",
    "ScalarMode",
    "ScalarWeights",
    "SumAndCount",
    "batched_part",
    "check_output_rules",
    "check_scalars",
    "chunk_weights",
    "combine",
    "concat_batched",
    "first_batch_size",
    "gather",
    "gather_outputs",
    "is_counted",
    "is_exact_mean",
    "is_marked",
    "mark_inputs",
    "marks_plain",
    "terms_note",
    "unmark",
    "unmark_inputs",
]
