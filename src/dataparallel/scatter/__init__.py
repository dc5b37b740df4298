"""Scatter: run a plan, giving each device its slice of the batch.

``take`` cuts and moves one slice (``_take``); ``WaveCut`` cuts a whole wave of a call of
plain tensors at once (``_cuts``); ``scatter`` and ``scatter_kwargs`` plan a call and take one
slice per device (``_scatter``). The plans are kept per call signature
(``_plans``): ``CallPlans`` for the functional API, ``PlanCache`` for a wrapper.

Other folders import this stage through this module, never its private modules: ``__all__``
is its interface (``dataparallel`` re-exports the public names).
"""

from __future__ import annotations

from dataparallel.scatter._cuts import WaveCut
from dataparallel.scatter._plans import CallPlans, PlanCache
from dataparallel.scatter._scatter import emit_warnings, scatter, scatter_kwargs
from dataparallel.scatter._take import take

__all__ = [
    "CallPlans",
    "PlanCache",
    "WaveCut",
    "emit_warnings",
    "scatter",
    "scatter_kwargs",
    "take",
]
