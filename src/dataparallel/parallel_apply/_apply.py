"""Run each replica on its device, on a process-wide pool of long-lived worker threads.

``torch.nn.parallel.parallel_apply`` starts one thread per replica on every call. Here each
(device, replica slot) has one daemon worker thread, named ``dataparallel-<device>-<slot>``
(``dataparallel-cpu-1``, ``dataparallel-cuda:1-0``), created on first use and reused by every
later call from any caller; a call costs one queue put and one ``Event`` wait per extra replica.
Replica 0 runs on the calling thread, while the others run on their workers: the caller would
only wait otherwise (so slot 0 of a device gets a worker only when it is not replica 0's).

Each task replays the caller's context in its worker:

- grad mode (``torch.is_grad_enabled()``);
- inference mode, a default device (``torch.set_default_device``) and the caller's
  ``contextvars`` (see :mod:`dataparallel.parallel_apply._thread_state`);
- autocast: the state (enabled, dtype) for the replica's device type, and the CPU autocast
  state too when the device is not the CPU;
- on CUDA, the device (``torch.cuda.device``) and a stream: the first replica on a device runs
  on the caller's current stream of that device, as in torch. A device listed again (``[0, 0]``)
  gets one pool-owned side stream per extra slot, so replicas on one GPU overlap: the side
  stream first waits for the caller's stream (inputs are ready), and the caller's stream then
  waits for the side stream (outputs are ready before the caller uses them).

State a worker cannot share (a ``torch.func`` transform, a dispatch mode or another function
mode, saved-tensor hooks) makes the call run every replica inline on the caller's thread, one
after another, so the result is one device's (``_thread_state``). So do
replicas that ``replicate`` marked (``_rebind.SERIAL``): a hook or forward of theirs leads to the
user's module through something that cannot be rebound to each replica.

A call made from inside a pool worker (a DataParallel nested in a replica's forward) runs its
replicas inline, one after another, instead of waiting on the pool it is part of.

Under ``torch.use_deterministic_algorithms(True)``, replicas that share a random generator
(every CPU replica shares the CPU's; replicas on one GPU share that GPU's) run one after
another on the caller's thread, in replica order: threads drawing from one generator at once
take their numbers in a racing order, so dropout would differ between two runs with the same
seed. Without it they run at once and CPU lists are not reproducible. ``in_order`` is the one
test of all the cases in which replicas run one after another.

A call's ``nn.SyncBatchNorm`` rendezvous (``_rendezvous``) is marked concurrent
only on the path that runs the replicas at once; on every path that runs them one after
another its layers act per chunk, so no replica ever waits for one that runs after it.

An exception in a replica is re-raised in the caller after every replica has finished, with the
same type where it can be built from one message, naming the replica, its device and its input
shapes, and chained from the original (whose traceback shows). Workers survive every error,
``KeyboardInterrupt`` included, so the next call uses the same threads. A Ctrl-C in the caller
waits for the replicas already running to finish their chunk (``_run_on_pool`` says why).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import queue
import threading
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from dataparallel.devices import DeviceSpec, check_runnable, device_type, resolve_devices
from dataparallel.parallel_apply import _thread_state as thread_state
from dataparallel.parallel_apply._rendezvous import ReplicaFailed, SyncCall
from dataparallel.parallel_apply._spans import Span, cuda_pool
from dataparallel.parallel_apply._thread_state import Replay
from dataparallel.replicate import SERIAL

__all__ = ["apply_replicas", "describe_inputs", "in_order", "parallel_apply", "wait_for"]

THREAD_PREFIX = "dataparallel-"

_local = threading.local()  # .in_worker: set in pool threads (nested calls run inline)
_pool_lock = threading.Lock()
# keyed by (device, slot): "cpu" and "cpu:1" are two devices, as their names are
_workers: dict[tuple[torch.device, int], _Worker] = {}
_side_streams: dict[tuple[str, int], Any] = {}
_pool_pid = os.getpid()


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
    span: Span | None = None
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
        try:
            torch.set_grad_enabled(task.grad)
            _run(task, None)
        except BaseException as exc:
            task.error = exc
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
    """The replica's forward, timed by a span when asked."""
    if task.sync:
        task.span = _span(task.device, stream)
    try:
        task.result = task.module(*task.args, **task.kwargs)
    finally:
        if task.span is not None:
            task.span.stop()
        if task.side is not None:
            task.stream.wait_stream(task.side)


def _execute_here(task: _Task) -> None:
    """Run a CPU task on the calling thread: its grad mode and autocast are the caller's own
    already, so nothing is replayed (the cost of one replica on one device is the forward)."""
    try:
        _run(task, None)
    except BaseException as exc:
        task.error = exc


class _Worker:
    """A daemon thread that runs tasks from its queue, forever."""

    def __init__(self, name: str) -> None:
        self.tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        _local.in_worker = True
        while True:
            task = self.tasks.get()
            try:
                if task.cancelled:
                    pass
                elif task.context is None:
                    _execute(task)
                else:
                    task.context.run(_execute, task)
            finally:
                task.finished = True
                task.done.release()
                del task  # drop the module and outputs before blocking again


def _worker(device: torch.device, slot: int) -> _Worker:
    global _pool_pid
    key = (device, slot)  # (not its name: str(device) costs more than the rest of the lookup)
    worker = _workers.get(key)
    if worker is not None and _pool_pid == os.getpid():
        return worker
    with _pool_lock:
        if _pool_pid != os.getpid():  # a forked child inherits the table but not the threads
            _workers.clear()
            _side_streams.clear()
            _pool_pid = os.getpid()
        worker = _workers.get(key)
        if worker is None:
            worker = _workers[key] = _Worker(f"{THREAD_PREFIX}{device}-{slot}")
        return worker


def _side_stream(device: torch.device, slot: int) -> Any:
    key = (str(device), slot)
    stream = _side_streams.get(key)
    if stream is None:
        with _pool_lock:
            stream = _side_streams.get(key)
            if stream is None:
                stream = _side_streams[key] = torch.cuda.Stream(device)
    return stream


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


# -- the public function ----------------------------------------------------------------------


def _infer_device(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> torch.device:
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return item.device
        if isinstance(item, (list, tuple)):
            stack[:0] = list(item)
        elif isinstance(item, Mapping):
            stack[:0] = list(item.values())
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    for value in module.__dict__.values():  # a replica keeps its parameters as plain attributes
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[DeviceSpec] | None = None,
    *,
    timings: list[Any] | None = None,
    syncbn: SyncCall | None = None,
) -> list[Any]:
    """Apply ``modules[i]`` to ``inputs[i]`` (and ``kwargs_tup[i]``) on ``devices[i]``, in
    parallel.

    Args:
        modules: one module (replica) per device.
        inputs: one entry per module: a ``tuple`` is unpacked as positional arguments; anything
            else (a tensor, a per-sample list chunk) is passed as the single argument.
        kwargs_tup: one keyword-argument mapping per module, or ``None``.
        devices: one device spec per module; ``None`` infers each from its first input tensor
            (else the module's first tensor, else the CPU).
        timings: if a list is given, it is filled with each replica's time: wall-clock seconds
            on the CPU; on CUDA a ``_spans.Span`` of pooled events on the
            replica's stream, whose ``float()`` gives the seconds (waiting for the stream only
            then, not per call).
        syncbn: the call's SyncBatchNorm rendezvous (``DataParallel`` makes it with
            ``_syncbn.sync_call``; see ``_rendezvous``); without it each replica's layers act
            per chunk.

    Returns:
        The outputs, in the order of ``modules``.

    Raises:
        ValueError: the argument lengths disagree, or a device spec is not usable.
        Exception: the first failing replica's error, with the same type where possible (else
            ``RuntimeError``), chained from the original.

    >>> lin = torch.nn.Linear(3, 2)
    >>> chunks = [torch.ones(2, 3), (torch.ones(1, 3),)]
    >>> outs = parallel_apply([lin, lin], chunks, devices=["cpu", "cpu"])
    >>> [tuple(o.shape) for o in outs]
    [(2, 2), (1, 2)]
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(
            f"inputs: expected one entry per module ({n}), got {len(inputs)}; pass the "
            f"result of scatter for the same devices"
        )
    if kwargs_tup is None:
        kwargs_tup = [{}] * n
    elif len(kwargs_tup) != n:
        raise ValueError(
            f"kwargs_tup: expected one mapping per module ({n}), got {len(kwargs_tup)}; pass "
            f"None or the kwargs from scatter_kwargs for the same devices"
        )
    if devices is None:
        argses = [x if isinstance(x, tuple) else (x,) for x in inputs]
        resolved = [
            _infer_device(m, a, k) for m, a, k in zip(modules, argses, kwargs_tup, strict=True)
        ]
    else:
        if len(devices) != n:
            raise ValueError(
                f"devices: expected one device per module ({n}), got {len(devices)}; pass the "
                f"devices the replicas were made for"
            )
        resolved = resolve_devices(devices, where="devices")
        check_runnable(resolved, where="devices")
    if timings is not None:
        timings.clear()  # replaced, not appended to
    return apply_replicas(modules, inputs, kwargs_tup, resolved, timings, syncbn)


def apply_replicas(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[Mapping[str, Any]],
    devices: Sequence[torch.device],
    timings: list[Any] | None = None,
    syncbn: SyncCall | None = None,
) -> list[Any]:
    """``parallel_apply`` for arguments already checked: one entry each per module, devices
    resolved and runnable (``DataParallel`` checked them at construction). ``timings``, when
    given, is extended with one entry per replica (a float, or a pending CUDA ``Span``).
    ``syncbn``, a SyncBatchNorm rendezvous, is marked concurrent only on the path that runs the
    replicas at once (every other path runs them one after another: its layers act per
    chunk, and nothing waits)."""
    n = len(modules)
    if n == 0:
        return []
    if syncbn is not None and n > 1:
        modules = cast(Sequence[nn.Module], syncbn.bind(modules))
    else:
        syncbn = None
    if n == 1 and device_type(devices[0]) != "cuda":
        return [_apply_here(modules[0], inputs[0], kwargs_tup[0], devices[0], timings)]
    grad = torch.is_grad_enabled()
    sync = timings is not None
    states: dict[str, list[tuple[str, torch.dtype]]] = {}
    tasks: list[_Task] = []
    worker_slots: list[int] = []  # the k-th replica on a device runs on that device's slot k
    slots: dict[torch.device, int] = {}
    for module, args, kwargs, device in zip(modules, inputs, kwargs_tup, devices, strict=True):
        slot = slots.get(device, 0)
        slots[device] = slot + 1
        kind = device_type(device)
        autocast = states.get(kind) if n > 1 else []  # one: the caller's thread
        if autocast is None:
            autocast = states[kind] = []
            for each in dict.fromkeys([kind, "cpu"]):
                enabled, dtype = _autocast_state(each)
                if enabled:  # only what a worker must replay
                    autocast.append((each, dtype))
        stream = side = None
        if kind == "cuda":
            stream = torch.cuda.current_stream(device)
            if slot > 0 and n > 1:
                side = _side_stream(device, slot)
        if not isinstance(args, tuple):  # one argument (a tensor, a per-sample list chunk)
            args = (args,)
        tasks.append(_Task(module, args, kwargs, device, grad, autocast, stream, side, sync))
        worker_slots.append(slot)

    why = ""
    if n == 1:  # one replica: no hop is cheaper
        _execute_first(tasks[0])
    elif getattr(_local, "in_worker", False):  # inside a worker: never wait on our own pool
        if syncbn is not None:
            syncbn.why = "a call nested in a replica's forward"
        for task in tasks:
            _execute(task)
    elif thread_state.must_run_inline():  # state the workers cannot share: run it here
        if syncbn is not None:
            syncbn.why = thread_state.active_state()
        for task in tasks:
            _execute_first(task)
        if any(t.error is not None for t in tasks):
            why = thread_state.active_state()
    elif (deterministic := _deterministic() and _shared_generator(devices)) or SERIAL in getattr(
        modules[1], "__dict__", ()
    ):
        # One after another on the caller's thread, in replica order: reproducible draws from
        # a generator the replicas share (deterministic algorithms), or a hook or forward that
        # leads to the user's module and cannot be rebound to each replica (replicate warned
        # once), which must never run from two threads at once.
        if syncbn is not None:
            syncbn.why = (
                "torch.use_deterministic_algorithms(True) (replicas sharing a generator run in "
                "order)"
                if deterministic
                else "a hook or forward that cannot be rebound to each replica"
            )
        for task in tasks:
            _execute_first(task)
    else:
        replay = thread_state.replay()
        context = thread_state.copy_context()
        for task in tasks[1:]:
            task.replay = replay
            if len(context):  # one copy per task: a context is entered by one thread at once
                task.context = context.copy()
        if syncbn is None:
            _run_on_pool(tasks, worker_slots)
        else:
            syncbn.concurrent = True
            # Interrupted, no replica may wait for one that will not run.
            _run_on_pool(tasks, worker_slots, syncbn.abort)

    if timings is not None:
        timings.extend(float("nan") if t.span is None else t.span.settled() for t in tasks)
    _reraise(tasks, why)
    return [t.result for t in tasks]


def _shared_generator(devices: Sequence[torch.device]) -> bool:
    """Whether two replicas draw from one random generator: every CPU replica shares the one
    CPU generator, replicas on one GPU (``[0, 0]``) share that GPU's."""
    keys = ["cpu" if device_type(d) == "cpu" else str(d) for d in devices]
    return len(set(keys)) < len(keys)


_deterministic = torch.are_deterministic_algorithms_enabled


def in_order(devices: Sequence[torch.device]) -> bool:
    """Whether a call's replicas on ``devices``, made now from this thread, run one after
    another on the calling thread (in replica order) rather than at once on the pool.

    They do inside a pool worker (a nested call), under thread state the workers cannot share
    (``_thread_state``), and under ``torch.use_deterministic_algorithms(True)``
    when two replicas share a random generator (every CPU replica shares the CPU's): threads
    drawing from one generator at once take their numbers in a racing order, so dropout would
    differ between two runs with the same seed. In order, replica 0 draws first, then replica
    1, and so on: the same seed gives the same result. Code that needs every replica of a call
    running at once (a collective across replicas) checks this first.
    """
    return len(devices) > 1 and (
        getattr(_local, "in_worker", False)
        or thread_state.must_run_inline()
        or (_deterministic() and _shared_generator(devices))
    )


def wait_for(lock: Any) -> None:
    """Take a wrapper's call lock that another thread holds.

    A pool worker never waits: the holder may be the very call it is running a replica for
    (a wrapper reachable from the replicas of another wrapper's module outside its tree, a
    plain attribute or a closure, is the same object on every replica), and waiting would hang
    for good. It is refused at once instead. Any other thread waits its turn.
    """
    if getattr(_local, "in_worker", False):
        raise RuntimeError(
            "DataParallel: a wrapper called from a replica's forward on a pool worker is busy "
            "with a call on another thread, expected a wrapper of its own for each replica: "
            "the wrapper is reachable from the replicas outside the module tree (a plain "
            "attribute, a list, a closure), so every replica shares it and waiting could hang "
            "for good. Register it as a submodule (self.inner = dp.DataParallel(...)): each "
            "replica then gets its own copy"
        )
    lock.acquire()


def _apply_here(
    module: nn.Module,
    args: Any,
    kwargs: Mapping[str, Any],
    device: torch.device,
    timings: list[Any] | None,
) -> Any:
    """One CPU replica on the calling thread: the forward, timed, and nothing else to set up
    (the caller's grad mode and autocast are its own). An error is re-raised as any replica's
    is, naming the replica, its device and its inputs."""
    if not isinstance(args, tuple):
        args = (args,)
    span = None if timings is None else _span(device, None)
    try:
        result = module(*args, **kwargs)
    except BaseException as exc:
        task = _Task(module, args, kwargs, device, True, [], None, None, False)
        task.error = exc
        del exc
        _reraise([task])
    if span is not None:
        span.stop()
        timings.append(span.value)  # type: ignore[union-attr]
    return result


def _execute_first(task: _Task) -> None:
    """Run the first task on the calling thread (a CPU one without replaying any context)."""
    if task.stream is None:
        _execute_here(task)
    else:
        _execute(task)


def _run_on_pool(
    tasks: list[_Task], slots: list[int], release: Callable[[BaseException], None] | None = None
) -> None:
    """Replicas 1.. on their pool workers, replica 0 on the caller's thread meanwhile.

    Running replica 0 here saves one hand-off and one wake-up per call, and the caller would
    only wait otherwise. On CUDA, ``_execute`` replays the same device and stream as a worker
    does (on the CPU the caller's grad mode and autocast are already its own). Errors are
    stored, not raised, so every replica has finished before ``_reraise`` looks.

    Interrupted while submitting or waiting (Ctrl-C), it skips the tasks no worker has started,
    calls ``release`` (a SyncBatchNorm rendezvous wakes the replicas waiting for one that will
    never come), and waits for the running ones to finish their chunk before the interrupt goes
    on: a program that ends on it while a worker is inside a torch operator aborts (the worker
    thread is stopped at interpreter exit inside C++ code, and the process dies with SIGABRT
    instead of its own exit status). A second Ctrl-C stops that wait. Every worker stays free
    for the next call.
    """
    submitted = 1
    try:
        for task, slot in zip(tasks[1:], slots[1:], strict=True):
            _worker(task.device, slot).tasks.put(task)
            submitted += 1
        _execute_first(tasks[0])
        for task in tasks[1:]:
            task.done.acquire()
    except BaseException as exc:
        started = tasks[1:submitted]
        for task in started:
            task.cancelled = True
        if release is not None:
            release(exc)
        for task in started:
            # A task whose lock this thread took already is marked finished; an interrupt
            # between the two lines finds the lock taken and ends on the worker's mark below.
            while not task.finished and not task.done.acquire(timeout=0.05):
                pass
        raise
