"""One replica's task: what of the caller it carries, how it runs, and how it fails.

A :class:`_Task` holds a replica, its arguments and what of the caller's thread the thread that
runs it must replay (``_execute``):

- grad mode (``torch.is_grad_enabled()``);
- inference mode, a default device (``torch.set_default_device``) and the caller's
  ``contextvars`` (see :mod:`dataparallel.parallel_apply._thread_state`);
- autocast: the state (enabled, dtype) for the replica's device type, and the CPU autocast
  state too when the device is not the CPU;
- on CUDA, the device (``torch.cuda.device``) and a stream: the first replica on a device runs
  on the caller's current stream of that device, as in torch. A device listed again (``[0, 0]``)
  gets one pool-owned side stream per extra slot (``_pool``), so replicas on one GPU overlap:
  the side stream first waits for the caller's stream (inputs are ready), and the caller's
  stream then waits for the side stream (outputs are ready before the caller uses them).

Running a task never raises: its error is stored (``KeyboardInterrupt`` too, so a worker
survives it), and ``_reraise`` raises in the caller after every replica has finished, with the
same type where it can be built from one message, naming the replica, its device and its input
shapes, and chained from the original (whose traceback shows).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from _thread import allocate_lock as _allocate_lock
from collections.abc import Mapping, Sequence
from time import perf_counter
from typing import Any, cast

import torch
from torch import nn

from dataparallel.parallel_apply._rendezvous import ReplicaFailed
from dataparallel.parallel_apply._spans import Span, cuda_pool
from dataparallel.parallel_apply._thread_state import Replay

__all__ = ["describe_inputs"]

_set_grad_enabled = torch._C._set_grad_enabled


# -- context capture and replay ---------------------------------------------------------------


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    """(enabled, dtype) of the caller's autocast for ``device_type``, on torch 2.1 and later."""
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: per-device functions
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        if device_type == "cuda":
            return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
        return False, torch.float32


@dataclasses.dataclass(slots=True, eq=False)
class _Task:
    """One replica's work and its result; ``done`` is released by whoever ran it.

    ``done`` is a bare lock, taken at creation: releasing it is the signal, acquiring it the
    wait (a ``threading.Event`` builds a condition and a lock per task, four times the cost).
    """

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    device: torch.device
    grad: bool
    autocast: list[tuple[str, torch.dtype]]
    stream: Any  # the caller's current stream on a CUDA device, else None
    side: Any  # a pool side stream for a repeated CUDA device, else None
    sync: bool  # time the replica (on CUDA: with pooled events, read later)
    # A CUDA replica's span; a CPU replica's seconds themselves (no object per replica).
    span: Span | float | None = None
    # Set by apply_replicas for a task that goes to a worker: the caller's thread state to
    # enter there, and a copy of its contextvars (None when it has none).
    replay: Replay = ()
    context: contextvars.Context | None = None
    result: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    finished: bool = False  # set by whoever ran or skipped it, then ``done`` is released
    done: Any = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.done = _allocate_lock()
        self.done.acquire()


def _execute(task: _Task) -> None:
    """Run one task with the caller's context; never raises (errors are stored)."""
    if task.stream is None and not task.autocast and not task.replay:
        # A CPU replica without autocast: only the grad mode to replay. Set as a function (no
        # context manager to build and exit): the worker's thread sets it for every task.
        # (``_run``'s CPU branch, inlined: a worker runs this once per call)
        start = perf_counter()
        try:
            _set_grad_enabled(task.grad)  # (what torch.set_grad_enabled's constructor does)
            task.result = task.module(*task.args, **task.kwargs)
        except BaseException as exc:
            task.error = exc
        if task.sync:
            task.span = perf_counter() - start
        return
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(task.grad))
            for device_type, dtype in task.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            for enter in task.replay:
                stack.enter_context(enter())
            stream = None
            if task.stream is not None:
                stack.enter_context(torch.cuda.device(task.device))
                stream = task.stream
                if task.side is not None:
                    task.side.wait_stream(task.stream)
                    stream = task.side
                stack.enter_context(torch.cuda.stream(stream))
            _run(task, stream)
    except BaseException as exc:  # KeyboardInterrupt too: the worker must live
        task.error = exc


def _span(device: torch.device, stream: Any) -> Span:
    """Start timing a replica: the one place replicas are timed (a CUDA replica on ``stream``,
    with events from its device's pool; any other with the wall clock)."""
    return Span() if stream is None else Span(cuda_pool(device), stream)


def _run(task: _Task, stream: Any) -> None:
    """The replica's forward, timed when asked: a CPU replica by the wall clock (its seconds
    are its span), a CUDA one by a span of events (``_span``'s choice, inlined: this runs once
    per replica per call)."""
    if task.sync and stream is None:
        start = perf_counter()
        try:
            task.result = task.module(*task.args, **task.kwargs)
        finally:
            task.span = perf_counter() - start
        return
    if task.sync:
        task.span = Span(cuda_pool(task.device), stream)
    try:
        task.result = task.module(*task.args, **task.kwargs)
    finally:
        if isinstance(task.span, Span):
            task.span.stop()
        if task.side is not None:
            task.stream.wait_stream(task.side)


def _execute_first(task: _Task) -> None:
    """Run the first task on the calling thread. It replays nothing: its grad mode and
    autocast are the caller's own already, and so, on CUDA, are its device and stream where
    the caller's current device is the task's (its stream is then the caller's current one,
    taken at the call) and it has no side stream: the cost of one replica on one device is
    the forward (entering ``torch.cuda.device`` and ``torch.cuda.stream`` again, each a few
    device lookups in Python, was most of the wrapper's cost on ``[0]``)."""
    if task.stream is not None:
        if task.side is None and torch.cuda.current_device() == task.device.index:
            try:
                _run(task, task.stream)
            except BaseException as exc:
                task.error = exc
        else:
            _execute(task)
        return
    # (``_run``'s CPU branch, inlined: the caller runs this once per call)
    start = perf_counter()
    try:
        task.result = task.module(*task.args, **task.kwargs)
    except BaseException as exc:
        task.error = exc
    if task.sync:
        task.span = perf_counter() - start


# -- errors --------------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(str(s) for s in value.shape)}]"
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple) and not isinstance(value, type):
        return f"{type(value).__name__}[{', '.join(str(s) for s in shape)}]"
    if isinstance(value, (list, tuple, dict)) or (
        isinstance(value, (Sequence, Mapping)) and not isinstance(value, (str, bytes))
    ):
        return f"{type(value).__name__}[{len(value)}]"
    return type(value).__name__


def describe_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None) -> str:
    """A short description of one replica's arguments: ``(Tensor[5, 3], list[2], k=int)``.

    >>> describe_inputs((torch.zeros(5, 3), [1, 2]), {"k": 3})
    '(Tensor[5, 3], list[2], k=int)'
    """
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in (kwargs or {}).items()]
    return f"({', '.join(parts)})"


def _reraise(tasks: list[_Task], why: str = "") -> None:
    """Raise the first stored error as described in the module docstring; ``why`` is added
    to the message when the replicas ran inline because of the caller's thread state."""
    failed = [i for i, t in enumerate(tasks) if t.error is not None]
    if not failed:
        return
    # A replica released from a SyncBatchNorm wait by another's failure reports that one's.
    released = [isinstance(t.error, ReplicaFailed) for t in tasks]
    failed.sort(key=released.__getitem__)
    i = failed[0]
    task = tasks[i]
    original = cast(BaseException, task.error)
    # Each stored error's traceback holds the frame that ran its task, and the task holds the
    # error: a reference cycle that would keep the module, replicas and inputs alive until the
    # garbage collector runs. Cut it here.
    for t in tasks:
        t.error = None
    others = f" (replicas {failed[1:]} failed too)" if len(failed) > 1 else ""
    message = (
        f"replica {i} on {task.device}, inputs {describe_inputs(task.args, task.kwargs)}: "
        f"{original}{others}"
    )
    if why:
        message += (
            f" (the replicas ran one after another on the calling thread, under {why}; it "
            f"fails the same way on one device, or the transform or mode cannot run this module)"
        )
    error: BaseException
    if isinstance(original, SystemExit):
        error = SystemExit(original.code)  # the exit status is the message: keep it
        if hasattr(error, "add_note"):
            error.add_note(message)
    else:
        try:
            error = type(original)(message)
        except Exception:  # a type that needs more than one argument
            error = RuntimeError(f"{type(original).__name__}: {message}")
    try:
        raise error from original
    finally:
        # This frame is in the raised error's traceback: holding the error in a local would be
        # a cycle too.
        del error, original, task, tasks
