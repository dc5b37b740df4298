"""Span and EventPool: one timer for CPU and CUDA, events reused only once they are done.

The pool is generic over its event factory, so its logic is driven here on the CPU by a small
stand-in for ``torch.cuda.Event`` on a stand-in stream whose work completes when the test says.
"""

from __future__ import annotations

import gc
import pickle

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.parallel_apply._spans import EventPool, Span, cuda_pool


class Stream:
    """A queue of work: ``finish(n)`` completes the first ``n`` recorded marks."""

    def __init__(self) -> None:
        self.recorded = 0
        self.finished = 0

    def finish(self, upto: int | None = None) -> None:
        self.finished = self.recorded if upto is None else upto


class Event:
    """What the pool needs of ``torch.cuda.Event``: record, query, synchronize, elapsed_time.

    Recording at mark ``k`` of a stream stamps the event with the time ``k`` seconds.
    """

    made = 0

    def __init__(self) -> None:
        Event.made += 1
        self.stream: Stream | None = None
        self.mark = 0
        self.records = 0

    def record(self, stream: Stream) -> None:
        stream.recorded += 1
        self.stream, self.mark = stream, stream.recorded
        self.records += 1

    def query(self) -> bool:
        return self.stream is None or self.stream.finished >= self.mark

    def synchronize(self) -> None:
        assert self.stream is not None
        self.stream.finished = max(self.stream.finished, self.mark)

    def elapsed_time(self, end: Event) -> float:
        assert self.query() and end.query(), "read before the work was done"
        return (end.mark - self.mark) * 1000.0  # ms


def test_cpu_span_reads_the_clock() -> None:
    span = Span()
    span.stop()
    assert span.settled() == float(span) >= 0.0


def test_a_cpu_span_read_before_stop_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="read before stop"):
        float(Span())


def test_warm_pool_makes_no_events_once_the_work_is_done() -> None:
    pool, stream = EventPool(Event), Stream()
    for _ in range(5):
        span = Span(pool, stream)
        span.stop()
        stream.finish()
    assert pool.made == 2  # one pair, reused by every later span once its work is done


def test_events_still_queued_are_not_reused() -> None:
    pool, stream = EventPool(Event), Stream()
    spans = []
    for _ in range(3):
        span = Span(pool, stream)
        span.stop()
        spans.append(span)
    # nothing finished: each span got fresh events, none shared
    events = [e for s in spans for e in (s.start, s.end)]
    assert pool.made == 6 and len({id(e) for e in events}) == 6
    assert all(e.records == 1 for e in events)


def test_an_old_span_keeps_its_reading_after_its_events_are_reused() -> None:
    pool, stream = EventPool(Event), Stream()
    old = Span(pool, stream)
    stream.recorded += 2  # two marks of work inside the span: 3 seconds from start to end
    old.stop()
    stream.finish()
    kept = dp.CallStats(["cuda:0"], [4], [old])  # a user keeps an old last_call
    newer = []
    for _ in range(3):  # the first reclaims old's events and records them again
        span = Span(pool, stream)
        span.stop()
        newer.append(span)
    assert old.start is None and old.end is None  # its events went back to the pool
    assert kept.seconds == [3.0]  # frozen when they were taken back
    stream.finish()
    assert [float(s) for s in newer] == [1.0, 1.0, 1.0]
    assert pool.made == 6  # old's pair, then two fresh pairs while the newer ones were queued


def test_reading_waits_for_the_end_event_when_not_done() -> None:
    pool, stream = EventPool(Event), Stream()
    span = Span(pool, stream)
    span.stop()
    assert span.settled() is span  # pending: read only when asked
    assert float(span) == 1.0 and stream.finished == stream.recorded  # synchronized
    assert span.settled() == 1.0


def test_last_call_of_a_cpu_wrapper_holds_floats() -> None:
    model = dp.DataParallel(nn.Linear(3, 2), ["cpu", "cpu"])
    model(torch.randn(4, 3))
    stats = model.last_call
    assert stats is not None and all(type(t) is float for t in stats.timers)
    pickle.loads(pickle.dumps(stats))  # a CPU CallStats pickles
    gc.collect()


@pytest.mark.cuda
def test_cuda_wrapper_reuses_events_and_keeps_old_readings() -> None:
    lin = nn.Linear(64, 64).cuda(0)
    model = dp.DataParallel(lin, [0, 0])
    x = torch.randn(256, 64, device="cuda:0")
    model(x)
    first = model.last_call
    assert first is not None
    pool = cuda_pool(torch.device("cuda", 0))
    for _ in range(5):
        model(x)
    torch.cuda.synchronize()
    warm = pool.made
    for _ in range(20):
        model(x)
        torch.cuda.synchronize()
    assert pool.made == warm  # no event allocated per call once warm
    assert all(s >= 0.0 for s in first.seconds)  # the old call's spans still read
    last = model.last_call
    assert last is not None and all(s >= 0.0 for s in last.seconds)
