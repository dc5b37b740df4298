"""``dataparallel.wrapper._results``: ``CallStats`` (``model.last_call``) and ``DeviceOutputs``.

The figures are checked against what they are made of (the chunk sizes the plan chose, the
timers given), and the ungathered outputs against the same module on one device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.wrapper._results import CallStats, DeviceOutputs

CPU3 = ["cpu", "cpu", "cpu"]


class Timer:
    """A timer that is read only when asked, as a CUDA span is."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.reads = 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_seconds_read_each_timer_when_asked() -> None:
    timers = [Timer(0.5), Timer(0.25)]
    stats = CallStats(["cpu", "cpu"], [4, 2], timers)
    assert [t.reads for t in timers] == [0, 0]
    assert stats.seconds == [0.5, 0.25]
    assert all(isinstance(s, float) for s in stats.seconds)
    assert [t.reads for t in timers] == [2, 2]  # read again on every access, never cached


def test_text_has_a_row_per_chunk_with_its_rate() -> None:
    stats = CallStats(["cpu", "cuda:1"], [4, 2], [0.5, 0.25])
    lines = str(stats).splitlines()
    assert lines[0].split() == ["replica", "device", "samples", "ms", "samples/s"]
    assert [line.split() for line in lines[1:]] == [
        ["0", "cpu", "4", "500.00", "8"],
        ["1", "cuda:1", "2", "250.00", "8"],
    ]
    assert len({len(line) for line in lines}) == 1  # columns aligned


def test_text_shows_a_dash_for_an_untimed_chunk_and_counts_waves() -> None:
    text = str(CallStats(["cpu", "cpu"], [3, 0], [0.1, 0.0], waves=2))
    assert text.splitlines()[2].split()[-1] == "-"
    assert text.splitlines()[-1] == "(2 waves)"
    assert "waves" not in str(CallStats(["cpu"], [3], [0.1]))


@pytest.mark.parametrize("opts", [{}, {"chunk_sizes": [1, 4, 2]}, {"max_size": 2}])
def test_last_call_records_the_plan_of_the_call(opts: dict[str, object]) -> None:
    x = torch.randn(7, 3)
    model = dp.DataParallel(nn.Linear(3, 2), CPU3, **opts)
    model(x)
    stats = model.last_call
    assert isinstance(stats, CallStats)
    plan = dp.plan((x,), None, CPU3, **opts)
    assert sum(stats.chunk_sizes) == 7
    assert len(stats.devices) == len(stats.chunk_sizes) == len(stats.seconds)
    assert all(s >= 0 for s in stats.seconds)
    assert stats.waves == len(plan.waves)
    if stats.waves == 1:
        assert stats.chunk_sizes == plan.chunk_sizes


@pytest.mark.parametrize("devices", [["cpu"], ["cpu:1"], CPU3])
def test_last_call_is_made_once_when_read_and_can_be_set(devices: list[str]) -> None:
    model = dp.DataParallel(nn.Linear(3, 2), devices)
    model(torch.randn(7, 3))
    stats = model.last_call
    assert isinstance(stats, CallStats)
    assert model.last_call is stats  # made from the call's record once, then kept
    assert stats.devices == [str(torch.device(d)) for d in devices]
    assert sum(stats.chunk_sizes) == 7 and len(stats.seconds) == len(devices)
    model.last_call = None
    assert model.last_call is None
    model(torch.randn(2, 3))
    assert model.last_call is not None and sum(model.last_call.chunk_sizes) == 2


def test_device_outputs_hold_each_chunk_and_rejoin_to_the_one_device_output() -> None:
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    x = torch.randn(7, 3)
    expected = module(x)
    outs = dp.DataParallel(module, CPU3, gather=False)(x)
    assert isinstance(outs, DeviceOutputs) and isinstance(outs, list)
    assert outs.chunk_sizes == [3, 2, 2]
    assert outs.devices == [torch.device("cpu")] * 3
    assert [o.shape[0] for o in outs] == outs.chunk_sizes
    torch.testing.assert_close(torch.cat(list(outs)), expected)


def test_device_outputs_copy_their_lists() -> None:
    devices, sizes = [torch.device("cpu")], [2]
    outs = DeviceOutputs([torch.zeros(2)], devices, sizes)
    devices.append(torch.device("meta"))
    sizes.append(5)
    assert (outs.devices, outs.chunk_sizes, len(outs)) == ([torch.device("cpu")], [2], 1)
