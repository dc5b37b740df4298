"""The plan: how a call's arguments are split over devices, decided before anything runs.

``plan`` is the public entry point (``dp.plan``); the parts live beside it, one job each:
``_build`` (``plan`` and ``build_plan``: the two passes in order, the plan assembled),
``_votes`` (pass 1 of the guide's "The batch rules": the votes and the batch size), ``_rules``
(pass 2: each leaf's rule, compiled into the program), ``_chunks`` (chunk sizes and waves),
``_program`` (what a plan holds) and ``_explain`` (its readable text). A wrapper's plans,
reused while a call's signature holds, are ``dataparallel.scatter._plans``'.

Other folders import this stage through this module, never its private modules: ``__all__``
is its interface (``dataparallel`` re-exports the public names).
"""

from __future__ import annotations

from dataparallel.plan._build import build_plan, check_options, plan
from dataparallel.plan._program import (
    BroadcastCut,
    Cut,
    Entry,
    PerSampleCut,
    Plan,
    Program,
    Rebuild,
    SplitCut,
    Step,
    Vote,
)
from dataparallel.plan._rules import holds_arrays
from dataparallel.plan._votes import list_kind

__all__ = [
    "BroadcastCut",
    "Cut",
    "Entry",
    "PerSampleCut",
    "Plan",
    "Program",
    "Rebuild",
    "SplitCut",
    "Step",
    "Vote",
    "build_plan",
    "check_options",
    "holds_arrays",
    "list_kind",
    "plan",
]
