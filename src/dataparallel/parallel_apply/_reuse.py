"""The warm call's hand-off: one caller's tasks for one set of CPU devices, kept between calls.

``apply_replicas`` builds a task per replica on every call and looks at the caller's thread
state to choose how they run. A ``DataParallel`` call repeated with the same plan (one per
training step) runs the same replicas on the same devices each time; ``TaskSlots`` keeps its
tasks, and ``apply_kept`` refills them with the call's modules, arguments and grad mode and
hands them to the same workers. Each task's ``done`` lock is left taken by the caller's wait
(``_pool._run_on_pool``), which is the state a new task starts in, so a kept task is ready again
when the call returns.

Reuse is for the plain case only, checked on every call in a few C calls: replicas on CPU
devices, none marked serial, no ``nn.SyncBatchNorm`` rendezvous, no autocast, no deterministic
algorithms, no state the workers cannot share (``_thread_state``), not inside a pool worker and
not inside another call that is using these tasks (a forward that calls its own wrapper).
Anything else goes to ``apply_replicas``, which handles every case; an interrupted hand-off
drops the kept tasks (their locks are in an unknown state), and the next call makes new ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dataparallel.devices import device_type
from dataparallel.parallel_apply import _thread_state as thread_state
from dataparallel.parallel_apply._apply import apply_replicas
from dataparallel.parallel_apply._pool import _local, _run_on_pool
from dataparallel.parallel_apply._task import _reraise, _Task

__all__ = ["TaskSlots", "apply_kept"]

_deterministic = torch.are_deterministic_algorithms_enabled
_autocast_enabled = torch.is_autocast_enabled  # (device_type) since torch 2.4
_must_run_inline = thread_state.must_run_inline
_replay = thread_state.replay
_copy_context = thread_state.copy_context
_NO_ARGS: tuple[Any, ...] = ()
_NO_KWARGS: Mapping[str, Any] = {}


class TaskSlots:
    """The kept tasks of one caller (a ``DataParallel`` wrapper's warm step) on ``devices``."""

    __slots__ = ("busy", "cpu", "devices", "tasks", "worker_slots")

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.cpu = len(devices) > 1 and all(device_type(d) == "cpu" for d in devices)
        slots: dict[torch.device, int] = {}
        self.worker_slots: list[int] = []
        for device in devices:  # the k-th replica on a device runs on that device's slot k
            self.worker_slots.append(slots.get(device, 0))
            slots[device] = self.worker_slots[-1] + 1
        self.tasks: list[_Task] | None = None
        self.busy = False


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
        not kept.cpu
        or kept.busy
        or getattr(_local, "in_worker", False)
        or _must_run_inline()
        or _deterministic()
        or _autocast_enabled("cpu")
    ):
        return apply_replicas(modules, inputs, kwargs_tup, kept.devices, timings)
    grad = torch.is_grad_enabled()
    tasks = kept.tasks
    if tasks is None:
        tasks = kept.tasks = [
            _Task(m, a, k, d, grad, [], None, None, True)
            for m, a, k, d in zip(modules, inputs, kwargs_tup, kept.devices, strict=True)
        ]
    else:
        for task, module, args, kwargs in zip(tasks, modules, inputs, kwargs_tup, strict=True):
            task.module, task.args, task.kwargs, task.grad = module, args, kwargs, grad
            task.cancelled = task.finished = False
    replay = _replay()
    context = _copy_context()
    copy = len(context) > 0  # one copy per task: a context is entered by one thread at once
    for task in tasks[1:]:
        task.replay = replay
        task.context = context.copy() if copy else None
    kept.busy = True
    try:
        _run_on_pool(tasks, kept.worker_slots)
    except BaseException:
        kept.tasks = None  # interrupted: their locks are in an unknown state
        raise
    finally:
        kept.busy = False
    try:
        for task in tasks:
            span = task.span
            timings.append(float("nan") if span is None else span.settled())
            if task.error is not None:
                _reraise(tasks)
        return [task.result for task in tasks]
    finally:
        for task in tasks:  # keep no batch, output, error or context alive between calls
            task.args, task.kwargs, task.context = _NO_ARGS, _NO_KWARGS, None
            task.span = task.result = task.error = None
