"""One timer for a replica's run: ``perf_counter`` on the CPU, pooled CUDA events on CUDA.

A :class:`Span` is started right before a replica's forward and stopped right after. On the
CPU it reads the wall clock. On CUDA it records two events on the replica's stream and reads
them only when asked (``float(span)``): waiting for the device on every call would block the
host and stall the queue of the next step's kernels.

The events come from a per-device :class:`EventPool`, so a warm wrapper allocates none per
call. A span hands its events back only once they are done: the pool looks at its oldest
stopped spans with ``event.query()`` (which never blocks), and for each one that has finished
it first freezes the span's reading into the span, then reuses the events. A span that a user
still holds (an old ``last_call``) therefore keeps its value, and an event whose work is still
queued is never recorded again: the pool makes a new one instead.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

__all__ = ["EventPool", "Span", "cuda_pool", "settled"]


class EventPool:
    """Timing events for one device, reused once the spans that recorded them are done.

    Generic over ``factory`` (for CUDA: ``torch.cuda.Event(enable_timing=True)``): an event
    needs ``record(stream)``, ``query()``, ``synchronize()`` and ``elapsed_time(other)`` (ms).
    Safe to use from several threads (replicas of one device run on different workers).
    """

    __slots__ = ("_factory", "_free", "_lock", "_stopped", "made")

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._stopped: deque[Span] = deque()  # oldest first: they finish roughly in order
        self._free: list[Any] = []
        self.made = 0  # events made so far (a warm pool stops making them)

    def take(self) -> tuple[Any, Any]:
        """A (start, end) pair of events that no unread span depends on."""
        with self._lock:
            stopped = self._stopped
            # Reclaim every finished span at the head; the first unfinished one ends the scan.
            while stopped and stopped[0].end.query():
                span = stopped.popleft()
                if span.value is None:
                    span.freeze()
                self._free += (span.start, span.end)
                span.start = span.end = None
            if len(self._free) >= 2:
                end = self._free.pop()
                return self._free.pop(), end
            self.made += 2
        return self._factory(), self._factory()

    def stopped(self, span: Span) -> None:
        """Track a span whose end event is now recorded, to reclaim its events when done."""
        with self._lock:
            self._stopped.append(span)

    def read(self, span: Span) -> float:
        """The span's seconds, waiting for its end event if it is still queued."""
        with self._lock:
            if span.value is not None:
                return span.value
            end = span.end
        end.synchronize()  # outside the lock: other replicas keep taking events meanwhile
        with self._lock:
            if span.value is None:  # not reclaimed meanwhile (which would have frozen it)
                span.freeze()
            return span.value  # type: ignore[return-value]


def settled(span: Span | float | None) -> float | Span:
    """A replica's timing for the record: its seconds (a CPU replica's span is its seconds
    already), a CUDA span read only when asked, NaN for a replica not timed."""
    if span is None:
        return float("nan")
    return span if type(span) is float else span.settled()  # type: ignore[union-attr]


class Span:
    """A replica's time: wall-clock seconds on the CPU, CUDA events on ``stream`` otherwise.

    ``float(span)`` gives the seconds; on CUDA the first read waits for the end event (unless
    the pool froze the reading already, when it reclaimed the events).

    >>> span = Span()
    >>> span.stop()
    >>> 0.0 <= float(span) < 1.0
    True
    """

    __slots__ = ("end", "pool", "start", "stream", "value")

    def __init__(self, pool: EventPool | None = None, stream: Any = None) -> None:
        self.pool = pool
        self.stream = stream
        self.value: float | None = None
        if pool is None:
            self.start: Any = perf_counter()
            self.end: Any = None
        else:
            self.start, self.end = pool.take()
            self.start.record(stream)

    def stop(self) -> None:
        """End the span (on CUDA: record the end event on the stream and drop the stream)."""
        pool = self.pool
        if pool is None:
            self.value = perf_counter() - self.start
            return
        self.end.record(self.stream)
        self.stream = None
        pool.stopped(self)

    def freeze(self) -> None:
        """Store the events' reading in the span (the end event must be done)."""
        self.value = float(self.start.elapsed_time(self.end)) / 1000.0

    def settled(self) -> float | Span:
        """The seconds as a float when known without waiting (CPU), else the span itself."""
        value = self.value
        return self if value is None else value

    def __float__(self) -> float:
        value = self.value
        if value is not None:
            return value
        if self.pool is None:
            raise RuntimeError("span: read before stop(); call stop() first")
        return self.pool.read(self)

    def __repr__(self) -> str:
        return f"Span({'pending' if self.value is None else f'{self.value:.6f}s'})"


_pools: dict[torch.device, EventPool] = {}
_pools_lock = threading.Lock()


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def cuda_pool(device: torch.device) -> EventPool:
    """The process-wide event pool of one CUDA device (events are bound to their device)."""
    pool = _pools.get(device)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(device)
            if pool is None:
                pool = _pools[device] = EventPool(_cuda_event)
    return pool
