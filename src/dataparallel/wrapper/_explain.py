"""What ``DataParallel.explain`` says of a call: its plan, with the notes only the wrapper knows.

The plan (``dataparallel.plan``) says how the arguments are split. The wrapper adds what
depends on its module: how outputs computed from ``num_items_in_batch`` are gathered, how scalar
outputs (a loss) are, which BatchNorm layers are synchronised over the replicas, and whether
``check=`` compares the call with one device's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dataparallel.gather import said_note, summing_note, terms_note
from dataparallel.parallel_apply import batchnorm_note
from dataparallel.plan import Plan, build_plan
from dataparallel.wrapper._partial_sums import find_count

__all__ = ["explain_call"]


def explain_call(
    module: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: list[torch.device],
    dim: int,
    options: Mapping[str, Any],
    *,
    weighted: bool = False,
    check: str | None = None,
    said: dict[Any, str] | None = None,
) -> Plan:
    """The plan of a call ``w(*inputs, **kwargs)`` of a wrapper of ``module`` on ``devices``,
    with the count's, the loss terms' and BatchNorm's notes; runs nothing. ``weighted``: the
    wrapper has ``scalar_weights``, which replace the terms' re-forming; ``check``: its check
    mode (``_one_device``); ``said``: how the wrapper's calls so far gathered each scalar output
    (``gather._loss``), said per output."""
    plan = build_plan(inputs, kwargs, devices, dim, **options)
    chunks = sum(len(wave) for wave in plan.slices)
    slot = find_count(module, inputs, kwargs)
    if slot is not None and chunks > 1:
        value = kwargs[slot] if isinstance(slot, str) else inputs[slot]
        plan.notes.append(summing_note(value, slot))
    terms = None if weighted or chunks < 2 else terms_note(inputs, kwargs)
    if terms:
        plan.notes.append(terms)
    if said and chunks > 1:
        plan.notes.append(said_note(said))
    note = batchnorm_note(module, plan.waves)
    if note:
        plan.notes.append(note)
    if chunks > 1 and check:
        plan.notes.append(_CHECK_ON)
    return plan


_CHECK_ON = (
    "check=: the call is compared with the same call on one device (outputs, then parameters "
    "and buffers, then gradients at backward), each difference a dp.OneDeviceDifference "
    "(check_every: which calls)"
)
