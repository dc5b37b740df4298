"""The warm call's hand-off: one caller's tasks for one set of CPU devices, kept between calls.

``apply_replicas`` builds a task per replica on every call and looks at the caller's thread
state to choose how they run. A ``DataParallel`` call repeated with the same plan (one per
training step) runs the same replicas on the same devices each time; ``TaskSlots`` keeps its
tasks, and ``apply_kept`` refills them with the call's modules, arguments and grad mode and
hands them to the same workers. Each task's ``done`` lock is left taken by the caller's wait
(in ``apply_kept``, as in ``_pool._run_on_pool``), which is the state a new task starts in, so a
kept task is ready again when the call returns.

Reuse is for the plain case only, checked on every call in a few C calls: replicas on CPU
devices, none marked serial, no ``nn.SyncBatchNorm`` rendezvous, no autocast, no deterministic
algorithms, no state the workers cannot share (``_thread_state``) nor a default device (a
function mode: ``apply_replicas`` replays it), not inside a pool worker and not inside
another call that is using these tasks (a forward that calls its own wrapper). Inference mode
is replayed here, as ``apply_replicas`` does.
Anything else goes to ``apply_replicas``, which handles every case; an interrupted hand-off
drops the kept tasks (their locks are in an unknown state), and the next call makes new ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from time import perf_counter
from typing import Any

import torch
from torch import nn

from dataparallel.devices import device_type
from dataparallel.parallel_apply import _pool
from dataparallel.parallel_apply import _thread_state as thread_state
from dataparallel.parallel_apply._apply import apply_replicas
from dataparallel.parallel_apply._pool import _local, interrupted, workers
from dataparallel.parallel_apply._task import _reraise, _Task
from dataparallel.replicate import check_writes

__all__ = ["TaskSlots", "apply_kept"]

# ``torch.are_deterministic_algorithms_enabled``'s C call itself (that function is a Python
# frame around it, run on every warm call before the hand-off).
_deterministic = getattr(
    torch._C, "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled
)
# Autocast on any device type sends the call to ``apply_replicas`` (one C call, no device name
# to parse); a torch without it asks for the CPU's.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cpu")
)
# thread_state's C calls, bound here: the kept path inlines ``must_run_inline`` (and sends any
# function mode, a default device included, to ``apply_replicas``), so its replay is at most
# inference mode.
_interpreter = thread_state._interpreter
_dispatch_modes = thread_state._dispatch_modes
_saved_hooks = thread_state._saved_hooks
_function_modes = thread_state._function_modes
_inference = thread_state._inference
_copy_context = thread_state.copy_context
_INFERENCE: thread_state.Replay = (torch.inference_mode,)
_NO_ARGS: tuple[Any, ...] = ()
_NO_KWARGS: Mapping[str, Any] = {}
_grad_enabled = torch.is_grad_enabled
_error_of = attrgetter("error")
_span_of = attrgetter("span")
_result_of = attrgetter("result")


class TaskSlots:
    """The kept tasks of one caller (a ``DataParallel`` wrapper's warm step) on ``devices``."""

    __slots__ = ("devices", "pid", "queues", "ready", "tasks", "worker_slots")

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        slots: dict[torch.device, int] = {}
        self.worker_slots: list[int] = []
        for device in devices:  # the k-th replica on a device runs on that device's slot k
            self.worker_slots.append(slots.get(device, 0))
            slots[device] = self.worker_slots[-1] + 1
        self.tasks: list[_Task] | None = None
        # The workers' queues, as found in process ``pid`` (a forked child finds its own; no
        # process has pid 0, so the first call looks them up).
        self.queues: list[Any] = []
        self.pid = 0
        # CPU devices only, and not in use by a call of this caller (a forward that calls its
        # own wrapper): one flag for the two, read first on every call.
        self.ready = len(devices) > 1 and all(device_type(d) == "cpu" for d in devices)


def apply_kept(
    kept: TaskSlots,
    modules: Sequence[nn.Module],
    inputs: Sequence[tuple[Any, ...]],
    kwargs_tup: Sequence[Mapping[str, Any]],
    timings: list[Any],
) -> list[Any]:
    """``apply_replicas(modules, inputs, kwargs_tup, kept.devices, timings)`` for replicas that
    are not marked serial and have no SyncBatchNorm rendezvous, on ``kept``'s tasks when the
    module docstring's conditions hold. ``inputs``: one tuple of positional arguments per
    replica."""
    if (
        not kept.ready
        or _local.in_worker
        or _interpreter() is not None
        or _dispatch_modes()
        or _function_modes()
        or _saved_hooks(False) is not None
        or _deterministic()
        or _any_autocast()
    ):
        return apply_replicas(modules, inputs, kwargs_tup, kept.devices, timings)
    # Only what decides the workers' tasks comes before the first put: these checks (a failed
    # one sends every replica to ``apply_replicas``, so none may run before), the grad mode,
    # replay and context the workers enter, and the queues. Replica 0 runs on this thread
    # (its grad mode, replay and context are its own already): its task is touched only after
    # the hand-off, and only when its forward fails (``_reraise`` names its inputs).
    grad = _grad_enabled()
    replay = _INFERENCE if _inference() else ()
    context = _copy_context()  # (true when it holds a variable: copied for every task then)
    tasks = kept.tasks
    if tasks is None:
        tasks = kept.tasks = [
            _Task(m, a, k, d, grad, [], None, None, True)
            for m, a, k, d in zip(modules, inputs, kwargs_tup, kept.devices, strict=True)
        ]
    queues = kept.queues
    if kept.pid != _pool._pool_pid:  # (read from the module: a fork rebinds it)
        queues = kept.queues = workers(kept.devices, kept.worker_slots)
        kept.pid = _pool._pool_pid
    each = zip(tasks, modules, inputs, kwargs_tup, strict=True)
    first, module, args, kwargs = next(each)  # replica 0's
    # ``_pool._run_on_pool`` and ``_task._execute_first`` for kept CPU tasks, in this frame
    # (the same order, errors and interrupt handling; ``cancelled`` is never set on a kept task
    # that is handed out: an interrupted hand-off drops them all).
    submitted = 1
    task: _Task  # (typed here: the loop below unpacks into its attributes)
    try:
        for (task, task.module, task.args, task.kwargs), inbox in zip(each, queues, strict=True):
            task.grad = grad
            task.replay = replay
            if context:  # one copy per task: a context is entered by one thread at once
                task.context = context.copy()
            inbox.put(task)
            submitted += 1
        kept.ready = False  # (a forward that calls its own wrapper: before replica 0 runs)
        result = None
        start = perf_counter()
        try:
            result = module(*args, **kwargs)
        except BaseException as exc:  # stored: every replica finishes before ``_reraise``
            first.error = exc
            first.args = args
            first.kwargs = kwargs
        first.span = perf_counter() - start
        others = tasks[1:]
        for task in others:
            task.done.acquire()
    except BaseException as exc:  # interrupted: see ``_run_on_pool``
        kept.tasks = None  # (tasks cancelled): their locks are in an unknown state
        interrupted(tasks[1:submitted], exc)
        raise
    finally:
        kept.ready = True
    try:
        if any(map(_error_of, tasks)):
            _reraise(tasks)  # (which drops every task's error: nothing holds its traceback)
        timings += map(_span_of, tasks)  # CPU replicas: each span is its seconds, a float
        check_writes(modules)
        return [result, *map(_result_of, others)]
    finally:
        for task in others:  # keep no batch, output or context alive between calls
            task.args = _NO_ARGS
            task.kwargs = _NO_KWARGS
            task.result = None
            # Ready for the next hand-off (reset here, after the join, not before the put: its
            # worker has released the task and reads it no more).
            task.finished = False
        first.args = _NO_ARGS
        first.kwargs = _NO_KWARGS
        if context:
            for task in tasks:
                task.context = None
