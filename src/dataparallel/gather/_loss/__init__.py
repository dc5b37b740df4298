"""A loss gathered from how forward built it (issue 59): one mechanism, one rule list.

``_rule`` decides how a scalar output is gathered, its top the ordered rules; ``_marks`` marks
what forward computes from a chunk's data, its loss terms and ``num_items_in_batch`` (one base,
one ``__torch_function__``, one record per call); ``_inputs`` marks each chunk's inputs as its
replica receives them; ``_reductions`` reads torch's loss functions' sums and denominators,
for those marks and for ``DataParallelCriterion``.
"""

from __future__ import annotations

from dataparallel.gather._loss._inputs import _NO_TARGET as NO_TARGET
from dataparallel.gather._loss._inputs import mark_inputs, marks_plain, unmark_inputs
from dataparallel.gather._loss._marks import COUNT_KEYWORD, Record, is_marked, unmark
from dataparallel.gather._loss._reductions import (
    ScalarWeights,
    SumAndCount,
    chunk_weights,
    combine,
    is_exact_mean,
)
from dataparallel.gather._loss._rule import (
    gather_marked,
    mean_of,
    refuse_escaped,
    said_note,
    say,
    summing_note,
    terms_note,
)

__all__ = [
    "COUNT_KEYWORD",
    "NO_TARGET",
    "Record",
    "ScalarWeights",
    "SumAndCount",
    "chunk_weights",
    "combine",
    "gather_marked",
    "is_exact_mean",
    "is_marked",
    "mark_inputs",
    "marks_plain",
    "mean_of",
    "refuse_escaped",
    "said_note",
    "say",
    "summing_note",
    "terms_note",
    "unmark",
    "unmark_inputs",
]
