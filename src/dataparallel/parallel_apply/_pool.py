"""The process-wide pool of long-lived worker threads that replicas 1.. run on.

``torch.nn.parallel.parallel_apply`` starts one thread per replica on every call. Here each
(device, replica slot) has one daemon worker thread, named ``dataparallel-<device>-<slot>``
(``dataparallel-cpu-1``, ``dataparallel-cuda:1-0``), created on first use and reused by every
later call from any caller; a call costs one queue put and one wait (a bare lock, see
``_task._Task``) per extra replica. Replica 0 runs on the calling thread, while the others run
on their workers: the caller would only wait otherwise (so slot 0 of a device gets a worker
only when it is not replica 0's). The pool also owns the side streams of a CUDA device listed
again (``[0, 0]``), one per extra slot. A forked child inherits the tables but not the threads:
its first lookup starts afresh.

A worker runs each task with the caller's context replayed (``_task`` says what) and marks
its thread (``_local.in_worker``): a call made from inside one runs its replicas inline
(``_apply``) instead of waiting on the pool it is part of. Workers survive every error,
``KeyboardInterrupt`` included, so the next call uses the same threads. A Ctrl-C in the caller
waits for the replicas already running to finish their chunk (``_run_on_pool`` says why).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

from dataparallel.parallel_apply._task import _execute, _execute_first, _set_grad_enabled, _Task

__all__ = ["THREAD_PREFIX"]

THREAD_PREFIX = "dataparallel-"


class _Local(threading.local):
    """A thread's pool state: ``in_worker`` is set in pool threads (nested calls run inline);
    a class default, so the check on every call is one attribute read."""

    in_worker = False


_local = _Local()
_pool_lock = threading.Lock()
# keyed by (device, slot): "cpu" and "cpu:1" are two devices, as their names are
_workers: dict[tuple[torch.device, int], _Worker] = {}
_side_streams: dict[tuple[str, int], Any] = {}
_pool_pid = os.getpid()


class _Worker:
    """A daemon thread that runs tasks from its queue, forever."""

    def __init__(self, name: str) -> None:
        self.tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        _local.in_worker = True
        get = self.tasks.get
        while True:
            task = get()
            try:
                if task.cancelled:
                    pass
                elif task.context is not None:
                    task.context.run(_execute, task)
                elif task.stream is None and not task.autocast and not task.replay:
                    # ``_execute``'s CPU branch, in this frame (a CPU replica without autocast:
                    # only the grad mode to replay); the caller waits on this, once per call.
                    start = perf_counter()
                    try:
                        _set_grad_enabled(task.grad)
                        task.result = task.module(*task.args, **task.kwargs)
                    except BaseException as exc:  # stored, never raised: the worker lives
                        task.error = exc
                    if task.sync:
                        task.span = perf_counter() - start
                else:
                    _execute(task)
            finally:
                task.finished = True
                task.done.release()
                del task  # drop the module and outputs before blocking again


def _forget_pool() -> None:
    """In a forked child: the tables were inherited, the threads were not (nor is the lock's
    state known). Registered with ``os.register_at_fork``, so a lookup needs no ``getpid``."""
    global _pool_lock, _pool_pid
    _workers.clear()
    _side_streams.clear()
    _pool_lock = threading.Lock()
    _pool_pid = os.getpid()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_forget_pool)


def _worker(device: torch.device, slot: int) -> _Worker:
    """The worker of ``(device, slot)``, started on first use (afresh in a forked child)."""
    key = (device, slot)  # (not its name: str(device) costs more than the rest of the lookup)
    worker = _workers.get(key)
    if worker is not None:
        return worker
    with _pool_lock:
        if _pool_pid != os.getpid():  # forked where register_at_fork does not exist
            _forget_pool()
        worker = _workers.get(key)
        if worker is None:
            worker = _workers[key] = _Worker(f"{THREAD_PREFIX}{device}-{slot}")
        return worker


def workers(devices: list[torch.device], slots: list[int]) -> list[queue.SimpleQueue[_Task]]:
    """The queues of the workers of replicas 1.. on ``devices`` (``slots``: each one's slot on
    its device), started where they are not yet."""
    return [_worker(d, slot).tasks for d, slot in zip(devices[1:], slots[1:], strict=True)]


def _side_stream(device: torch.device, slot: int) -> Any:
    """The pool's CUDA stream for slot ``slot`` (> 0) of ``device``, made on first use."""
    key = (str(device), slot)
    stream = _side_streams.get(key)
    if stream is None:
        with _pool_lock:
            stream = _side_streams.get(key)
            if stream is None:
                stream = _side_streams[key] = torch.cuda.Stream(device)
    return stream


def _run_on_pool(
    tasks: list[_Task],
    slots: list[int],
    release: Callable[[BaseException], None] | None = None,
    queues: list[queue.SimpleQueue[_Task]] | None = None,
) -> None:
    """Replicas 1.. on their pool workers, replica 0 on the caller's thread meanwhile.

    ``queues``: the workers' queues of tasks 1.., as ``workers`` found them in this process (a
    caller that keeps its tasks keeps them too).

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
        if queues is None:
            for task, slot in zip(tasks[1:], slots[1:], strict=True):
                _worker(task.device, slot).tasks.put(task)
                submitted += 1
        else:
            for task, inbox in zip(tasks[1:], queues, strict=True):
                inbox.put(task)
                submitted += 1
        _execute_first(tasks[0])
        for task in tasks[1:]:
            task.done.acquire()
    except BaseException as exc:
        interrupted(tasks[1:submitted], exc, release)
        raise


def interrupted(
    started: list[_Task],
    exc: BaseException,
    release: Callable[[BaseException], None] | None = None,
) -> None:
    """A hand-off interrupted (Ctrl-C) after ``started`` were given to their workers: skip
    those no worker has begun, call ``release``, and wait for the running ones to finish their
    chunk (``_run_on_pool`` says why)."""
    for task in started:
        task.cancelled = True
    if release is not None:
        release(exc)
    for task in started:
        # A task whose lock this thread took already is marked finished; an interrupt
        # between the two lines finds the lock taken and ends on the worker's mark below.
        while not task.finished and not task.done.acquire(timeout=0.05):
            pass
