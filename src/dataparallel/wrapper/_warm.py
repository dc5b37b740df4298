"""The warm call: one cached step per kept plan, for the call a training loop repeats.

``DataParallel._pipeline`` serves every call: waves, overrides, counts, compiled replicas, step
methods. The call most loops make on every step has none of them: plain tensors, split over
the same devices in the same sizes, through the built-in steps. For it, a ``WarmStep`` is made
once per kept plan (stored in the plan's ``memo``, shared by every call bound to that plan) and
holds what the general path works out on every call:

- the chunks: ``scatter.WaveCut`` cuts each tensor into every chunk at once;
- the replicas: the resolved device tuple of the wrapper's replica set, so the check reads the
  kept set directly (``ReplicaSets.kept``; the check itself is the same, complete one);
- the hand-off: the replicas' tasks, kept and refilled (``parallel_apply.TaskSlots``), with
  the caller's thread state checked on every call and anything unusual sent to the general
  ``apply_replicas``;
- the gather: plain tensor outputs are concatenated with the plan's sizes; what each replica
  received (``Origins``, for scalars) is put together only when another rule is needed.

Every step computes what the general path computes (the suite runs both on the same calls);
only the bookkeeping is done once instead of per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dataparallel.gather import Origins, concat_batched, mark_inputs, marks_plain
from dataparallel.parallel_apply import TaskSlots, apply_kept, apply_replicas, sync_call
from dataparallel.plan import Plan
from dataparallel.replicate import ReplicaSets, serial_mark
from dataparallel.scatter import WaveCut
from dataparallel.wrapper._partial_sums import find_count
from dataparallel.wrapper._placement import copy_writes_back
from dataparallel.wrapper._results import DeviceOutputs, new_load, record
from dataparallel.wrapper._waves import Overrides, Wrapper, gather_all, replicate_wave

__all__ = ["WarmStep", "warm_call", "warm_step"]

_WARM = "warm"  # the memo's key of the step
_PLAIN = "plain"  # ... and of a forward that takes no count from its calls (``warm_step``)


class WarmStep:
    """What a call of one kept plan reuses: its cut, devices, sizes and kept tasks."""

    __slots__ = ("cut", "devices", "resolved", "sizes", "tasks")

    def __init__(self, cut: WaveCut) -> None:
        self.cut = cut
        self.devices: list[torch.device] = cut.devices
        self.sizes: list[int] = cut.sizes
        self.resolved = tuple(cut.devices)  # the replica sets' key for these devices
        self.tasks = TaskSlots(cut.devices)

    def run(
        self,
        w: Wrapper,
        plan: Plan,
        module: nn.Module,
        replicas: list[nn.Module],
        args: list[tuple[Any, ...]],
        kws: list[dict[str, Any]],
        steps: Overrides,
    ) -> Any:
        """The call from the hand-off on, for replicas in line with ``module``, not marked
        serial and with no SyncBatchNorm rendezvous: the kept tasks, then the gather."""
        timers: list[Any] = []
        outputs = apply_kept(self.tasks, replicas, args, kws, timers)
        # ``finish`` with ``record`` inlined, in this frame (the warm call's own path after the
        # join: each frame costs there, with the caches cold after a backward).
        if replicas[0] is not module:
            copy_writes_back(replicas[0], module)
        state = w.__dict__
        devices, sizes = self.devices, self.sizes
        load = new_load((devices, sizes, timers, 1))
        calls = state.get("_calls")
        if calls is None:
            record(state, load)
        else:
            calls.last = load
        if not w.gather_outputs:
            return DeviceOutputs(outputs, devices, sizes)
        if not state.get("output_rules"):  # (a wrapper unpickled from before has none)
            out = concat_batched(outputs, w.output_device, w.dim, sizes)
            if out is not None:
                return out
        origins = Origins(replicas, plan.program, args, kws)
        return gather_all(w, outputs, devices, sizes, None, steps, None, origins, None)

    def finish(
        self,
        w: Wrapper,
        plan: Plan,
        module: nn.Module,
        replicas: list[nn.Module],
        outputs: list[Any],
        args: list[tuple[Any, ...]],
        kws: list[dict[str, Any]],
        timers: list[Any],
        steps: Overrides,
    ) -> Any:
        """The call after the join: writes back, the record, the gather (rule 1, a plain
        concatenation, when no output rule is set and the outputs allow it)."""
        devices, sizes = self.devices, self.sizes
        if replicas[0] is not module:
            copy_writes_back(replicas[0], module)
        record(w.__dict__, new_load((devices, sizes, timers, 1)))
        if not w.gather_outputs:
            return DeviceOutputs(outputs, devices, sizes)
        if not w.__dict__.get("output_rules"):  # (a wrapper unpickled from before has none)
            out = concat_batched(outputs, w.output_device, w.dim, sizes)
            if out is not None:
                return out
        origins = Origins(replicas, plan.program, args, kws)
        return gather_all(w, outputs, devices, sizes, None, steps, None, origins, None)


def warm_step(
    w: Wrapper,
    plan: Plan,
    steps: Overrides,
    module: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> WarmStep | None:
    """The warm step of the kept plan ``plan`` (a template), made on first use from this call
    of its signature; ``None`` for a call the step cannot serve: a plan built for this call
    alone, a step overridden, scalar weights, compiled replicas, an own ``replicate``, a count
    passed (``num_items_in_batch``), or a plan ``WaveCut.of`` cannot cut, or of one chunk."""
    memo = plan.memo
    state = w.__dict__
    if (
        memo is None
        or True in steps  # (any(steps), without the call)
        or w.scalar_weights is not None
        or state.get("compile_options") is not None
        or "replicate" in state
    ):
        return None
    step: WarmStep | None
    try:
        step = memo[_WARM]
    except KeyError:
        cut = WaveCut.of(plan, inputs, kwargs)
        step = memo[_WARM] = None if cut is None or len(cut.devices) < 2 else WarmStep(cut)
    if step is None:
        return None
    # memo[_PLAIN]: a forward function that takes no count from this plan's calls. Whether a
    # call passes the count (``find_count``) depends on its keyword names and number of
    # positional arguments, fixed by the plan's key (a warm plan's arguments are all plain
    # tensors, never ``None``), and on the forward's parameters: so it is answered once per
    # forward function, and again whenever ``module.forward`` (read on every call) is another
    # function. (The plan, this wrapper's, holds that function until then.)
    forward: Any = module.forward
    try:
        func = forward.__func__  # a method: its function (a bound method is made per read)
    except AttributeError:
        func = forward
    if memo.get(_PLAIN) is func:
        return step
    if find_count(module, inputs, kwargs) is not None:
        return None
    memo[_PLAIN] = func
    return step


def warm_call(
    w: Wrapper,
    step: WarmStep,
    plan: Plan,
    module: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    steps: Overrides,
) -> Any:
    """``_pipeline``'s result for a call that its warm step serves: no step overridden, no
    count, no scalar weights, no compiled replicas, one wave of plain tensors. ``plan``: the
    kept template (the call's arguments are ``inputs`` and ``kwargs``)."""
    state = w.__dict__
    args, kws = step.cut(plan, inputs, kwargs)
    if marks_plain(inputs, kwargs):  # a loss's terms are observed (gather._loss)
        args, kws = mark_inputs(args, kws)
    devices = step.devices
    sets: ReplicaSets | None = state.get("_replica_sets")
    kept = None if sets is None else sets.kept(module, step.resolved)
    if kept is None:  # the first call, or a new structure: built as always
        replicas = replicate_wave(w, devices, False, steps)
        serial = serial_mark(replicas)
        sync = sync_call(state, replicas, devices)
    else:  # (their marks as the last sync left them; a rendezvous made on every call)
        replicas, serial, syncbn = kept
        sync = sync_call(state, replicas, devices) if syncbn else None
    if serial or sync is not None:
        timers: list[Any] = []
        outputs = apply_replicas(replicas, args, kws, devices, timers, sync, serial)
        return step.finish(w, plan, module, replicas, outputs, args, kws, timers, steps)
    return step.run(w, plan, module, replicas, args, kws, steps)
