"""Run each replica on its device: at once on the worker pool, or one after another.

``parallel_apply`` checks its arguments; ``apply_replicas`` makes a task per replica
(:mod:`dataparallel.parallel_apply._task`: the caller's context it replays, its errors) and
picks the path. At once, replica 0 runs on the calling thread while the others run on their
(device, slot) workers (:mod:`dataparallel.parallel_apply._pool`).

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
seed. Without it they run at once and CPU lists are not reproducible. A call with
``nn.SyncBatchNorm`` layers in training runs them on the pool instead, taking turns in replica
order (``_rendezvous``: ``ordered``), so the layers still meet and see the whole batch.
``in_order`` is the one test of all the cases in which replicas run one after another.

A call's ``nn.SyncBatchNorm`` rendezvous (``_rendezvous``) is marked concurrent
only on the path that runs the replicas at once; on every path that runs them one after
another its layers act per chunk, so no replica ever waits for one that runs after it.

An exception in a replica is re-raised in the caller after every replica has finished, naming
the replica, its device and its input shapes (``_task._reraise``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from dataparallel.devices import DeviceSpec, check_runnable, device_type, resolve_devices
from dataparallel.parallel_apply import _thread_state as thread_state
from dataparallel.parallel_apply._pool import _local, _run_on_pool, _side_stream
from dataparallel.parallel_apply._rendezvous import SyncCall
from dataparallel.parallel_apply._spans import settled
from dataparallel.parallel_apply._task import (
    _autocast_state,
    _execute,
    _execute_first,
    _reraise,
    _span,
    _Task,
)
from dataparallel.replicate import check_writes, serial_mark

__all__ = ["apply_replicas", "as_arguments", "in_order", "parallel_apply", "wait_for"]


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[DeviceSpec] | None = None,
    *,
    timings: list[Any] | None = None,
    syncbn: SyncCall | None = None,
    serial: str | None = None,
) -> list[Any]:
    """Apply ``modules[i]`` to ``inputs[i]`` (and ``kwargs_tup[i]``) on ``devices[i]``, in
    parallel.

    Args:
        modules: one module (replica) per device.
        inputs: one entry per module: a ``tuple`` or a ``list`` is unpacked as positional
            arguments (torch's convention: ``[[batch0], [batch1]]`` passes ``batch0`` to the
            first module); anything else (a tensor, a dict) is passed as the single argument.
            A per-sample list chunk of ``dp.scatter`` meant as one argument goes in a tuple:
            ``dp.scatter((items,), devices)`` gives one.
        kwargs_tup: one keyword-argument mapping per module, or ``None``.
        devices: one device spec per module; ``None`` infers each from its first input tensor
            (else the module's first tensor, else the CPU).
        timings: if a list is given, it is filled with each replica's time: wall-clock seconds
            on the CPU; on CUDA a span of events on the replica's stream, whose ``float()``
            gives the seconds (waiting for the stream only then, not per call).
        syncbn: ``DataParallel``'s own: the call's SyncBatchNorm rendezvous, which the wrapper
            makes per call; leave it ``None`` (each replica's BatchNorm layers act per chunk).
        serial: why the replicas must run one after another on the calling thread (the mark
            ``replicate`` set on them, read by a caller that runs them wrapped: compiled, as
            step methods); ``None`` reads it from ``modules`` themselves.

    Returns:
        The outputs, in the order of ``modules``.

    Raises:
        ValueError: the argument lengths disagree, or a device spec is not usable.
        Exception: the first failing replica's error, with the same type where possible (else
            ``RuntimeError``), chained from the original.

    Example:
        >>> import torch, dataparallel as dp
        >>> lin = torch.nn.Linear(3, 2)
        >>> chunks = [torch.ones(2, 3), (torch.ones(1, 3),)]
        >>> outs = dp.parallel_apply([lin, lin], chunks, devices=["cpu", "cpu"])
        >>> [tuple(o.shape) for o in outs]
        [(2, 2), (1, 2)]
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(
            f"inputs: expected one entry per module ({n}), got {len(inputs)}; pass the "
            f"result of scatter for the same devices"
        )
    inputs = as_arguments(inputs)
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
            infer_device(m, a, k) for m, a, k in zip(modules, argses, kwargs_tup, strict=True)
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
    return apply_replicas(modules, inputs, kwargs_tup, resolved, timings, syncbn, serial)


def as_arguments(inputs: Sequence[Any]) -> Sequence[Any]:
    """Each replica's entry with a ``list`` read as its positional arguments, as torch's
    ``parallel_apply`` reads it (a ``scatter`` override in torch's style returns one list of
    arguments per device); the entries themselves otherwise unchanged.

    >>> as_arguments([[1], (2, 3), 4])
    [(1,), (2, 3), 4]
    """
    if not any(isinstance(x, list) for x in inputs):
        return inputs
    return [tuple(x) if isinstance(x, list) else x for x in inputs]


def apply_replicas(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[Mapping[str, Any]],
    devices: Sequence[torch.device],
    timings: list[Any] | None = None,
    syncbn: SyncCall | None = None,
    serial: str | None = None,
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
    if serial is None:  # read before any wrapping below
        serial = serial_mark(modules)
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
    elif _local.__dict__.get("in_worker", False):  # inside a worker: never wait on our own pool
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
    elif (syncbn is None and _deterministic() and _shared_generator(devices)) or serial:
        # One after another on the caller's thread, in replica order: reproducible draws from
        # a generator the replicas share (deterministic algorithms; with SyncBatchNorm layers
        # they take turns on the pool instead, below), or a hook or forward that leads to the
        # user's module and cannot be rebound to each replica (replicate warned once), which
        # must never run from two threads at once.
        if syncbn is not None:  # (deterministic runs with SyncBatchNorm take turns instead)
            syncbn.why = "a hook or forward that cannot be rebound to each replica"
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
            # Deterministic algorithms and a shared generator: the replicas take turns (in
            # replica order, handing on at each layer), so their draws keep one order.
            syncbn.ordered = _deterministic() and _shared_generator(devices)
            # Interrupted, no replica may wait for one that will not run.
            _run_on_pool(tasks, worker_slots, syncbn.abort)

    if timings is not None:
        timings.extend(settled(t.span) for t in tasks)
    _reraise(tasks, why)
    check_writes(modules)  # a trainable parameter the replicas share, written in forward
    return [t.result for t in tasks]


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


def infer_device(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> torch.device:
    """The device of the first tensor in the arguments (depth first), else of the module's
    first tensor (a parameter, a buffer, or a replica's plain tensor attribute), else the CPU."""
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
    running at once (a collective across replicas) checks this first. (A call with a
    SyncBatchNorm rendezvous under deterministic algorithms runs its replicas on the pool in
    turns instead, ``apply_replicas``: they still meet at the layers.)
    """
    return len(devices) > 1 and (
        _local.__dict__.get("in_worker", False)
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
    if _local.__dict__.get("in_worker", False):
        raise RuntimeError(
            "DataParallel: a wrapper called from a replica's forward on a pool worker is busy "
            "with a call on another thread, expected a wrapper of its own for each replica: "
            "the wrapper is reachable from the replicas outside the module tree (a plain "
            "attribute, a list, a closure), so every replica shares it and waiting could hang "
            "for good. Register it as a submodule (self.inner = dp.DataParallel(...)): each "
            "replica then gets its own copy"
        )
    lock.acquire()
