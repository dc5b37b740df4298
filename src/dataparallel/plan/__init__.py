"""The plan: how a call's arguments are split over devices, decided before anything runs.

``plan`` is the public entry point (``dp.plan``); the parts live beside it, one job each:
``_rules`` (the votes and the leaf rules of the guide's "The batch rules"), ``_chunks`` (chunk
sizes and waves), ``_program`` (what a plan holds), ``_explain`` (its readable text) and
``_cache`` (a wrapper's plans, reused while a call's signature holds).
"""

from __future__ import annotations

from dataparallel.plan._program import Entry, Plan, Vote
from dataparallel.plan._rules import build_plan, check_options, plan

__all__ = ["Entry", "Plan", "Vote", "build_plan", "check_options", "plan"]
