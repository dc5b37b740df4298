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

from dataparallel.gather import (
    NO_TARGET,
    Origins,
    concat_batched,
    mark_inputs,
    marks_plain,
    unmark_inputs,
)
from dataparallel.parallel_apply import (
    TaskSlots,
    apply_kept,
    apply_replicas,
    sync_call,
    wait_for,
)
from dataparallel.plan import Plan
from dataparallel.replicate import ReplicaSets, serial_mark
from dataparallel.scatter import WaveCut
from dataparallel.wrapper._one_device import checked_call
from dataparallel.wrapper._partial_sums import find_count
from dataparallel.wrapper._placement import (
    check_module_device,
    check_on_device,
    copy_writes_back,
    run_here,
)
from dataparallel.wrapper._results import DeviceOutputs, new_load, record
from dataparallel.wrapper._waves import Overrides, Wrapper, gather_all, replicate_wave

__all__ = ["WarmStep", "run_call", "warm_call", "warm_step"]

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
    marks: bool | None = None,
) -> Any:
    """``_pipeline``'s result for a call that its warm step serves: no step overridden, no
    count, no scalar weights, no compiled replicas, one wave of plain tensors. ``plan``: the
    kept template (the call's arguments are ``inputs`` and ``kwargs``); ``marks``: whether the
    chunks are marked, where the caller read it (``marks_plain``'s answer), else ``None``."""
    state = w.__dict__
    args, kws = step.cut(plan, inputs, kwargs)
    if marks is None:
        marks = marks_plain(inputs, kwargs)
    if marks:  # a loss's terms are observed (gather._loss)
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


def run_call(w: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``DataParallel.forward``'s body, with its arguments as they came (no repacking).
    (``w`` is typed loosely: this module imports nothing of the class's.)

    The call a loop repeats, one plain tensor with everything as at the last call, is served
    from the wrapper's last warm call (``PlanCache.warm``): one comparison of the call's key
    stands for the plan's look-up (``PlanCache.find``) and ``warm_step``'s checks. The key holds
    everything either reads: the plan options, dim and devices (as copies, kept only while every
    option is an immutable value, as ``find`` keeps them), the overridden steps, the scalar
    weights, the compile options, an own ``replicate``, ``module.forward`` (a bound method
    compares equal only for the same module and function) and the tensor's shape and layout
    (the plan's key for it). Any of them changed: the key differs and the call takes the full
    look-up, which keeps its new warm call."""
    if _compiling():
        # torch.compile(wrapper): the pipeline runs outside dynamo (which cannot trace its
        # threads and locks), with a warning naming compile=.
        return torch.compiler.disable(w._eager_forward, reason=_NOT_TRACED)(inputs, kwargs)
    state = w.__dict__
    if "_is_replica" in state:  # a copy in another wrapper's replica
        run_here(state, w._modules["module"], inputs, kwargs)
    lock = state.get("_lock") or w._call_lock()
    if not lock.acquire(False):  # (not blocking)
        wait_for(lock)
    try:
        try:  # the module's place: ``_placement.sentinels_hold``'s test, inline (no frame)
            ref, table, name, last_ref, last_table, last_name = state["_sentinels"]
            first = getattr(ref(), table)[name]
            last = getattr(last_ref(), last_table)[last_name]
            device = w.src_device_obj  # (``is_cpu`` is a flag; ``device`` a new object)
            held = (first.is_cpu and last.is_cpu and device == _CPU) or (
                first.device == device and last.device == device
            )
        except (TypeError, ValueError, AttributeError, KeyError):
            held = False  # no sentinels yet, none (no tensor), a freed module or tensor, ...
        if not held:  # the full check (which answers the cases above that are not misplaced)
            check_module_device(state, w.module, w.src_device_obj)
        try:
            if kwargs or len(inputs) != 1 or type(a := inputs[0]) is not _Tensor:
                # (one plain tensor, the common call, is never marked)
                inputs, kwargs = unmark_inputs(inputs, kwargs)  # a Target of an earlier call
                a = None
            if state.get("check_mode") is not None:
                return checked_call(w, inputs, kwargs)  # check= (``_one_device``)
            module: nn.Module = w._modules["module"]
            plans = state.get("_plans") or w._plan_cache()
            key = None
            if a is not None:
                try:
                    key = (
                        w.options,
                        w.dim,
                        w.device_ids,
                        state.get("_steps"),
                        w.scalar_weights,
                        state.get("compile_options"),
                        "replicate" in state,
                        module.forward,
                        a.shape,
                        a.layout,
                    )
                except RuntimeError:  # a nested tensor has no shape to read: the rules name it
                    key = None
                kept, step, plan, steps = plans.warm
                if kept == key:  # (compared in C)
                    # (``marks_plain``'s test for one tensor, inline)
                    marks = a.dtype not in NO_TARGET and a.ndim > 0
                    return warm_call(w, step, plan, module, inputs, kwargs, steps, marks)
            # _pipeline's start, here: most loops' calls are served by a kept plan's step
            steps = state.get("_steps") or w._find_overrides()
            found = plans.find(inputs, kwargs, w.device_ids, w.dim, w.options)
            if found.warnings:
                w._warn_once(found)
            warm = warm_step(w, found, steps, module, inputs, kwargs)
            if warm is None:
                return w._pipeline(inputs, kwargs, None, found)
            given = plans.last[0]  # (options, dim, devices) as copies, or None: not kept
            if key is not None and given is not None and not found.warnings:
                plans.warm = ((*given, steps, *key[4:]), warm, found, steps)
            # a kept plan's call, which a loop repeats: one cached step
            return warm_call(w, warm, found, module, inputs, kwargs, steps)
        except RuntimeError:
            check_on_device(w.module, w.src_device_obj)  # clearer, if one is misplaced
            raise
    finally:
        lock.release()


_compiling = torch.compiler.is_compiling  # (dynamo knows the function, by whatever name)
_Tensor = torch.Tensor
_CPU = torch.device("cpu")

_NOT_TRACED = "dataparallel: the wrapper's scatter, threads and gather run eagerly; compile="
