"""A warm wrapper used again in a forked child: its kept tasks go to the child's own workers
(the parent's threads do not exist there), so the call runs instead of waiting forever."""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp


def _call_in_child(wrapper: Any, x: torch.Tensor, expected: torch.Tensor, out: Any) -> None:
    try:
        with torch.no_grad():
            got = wrapper(x)
        scale = expected.abs().max().item() + 1e-12
        out.put(float((got - expected).abs().max().item() / scale))
    except BaseException as exc:  # reported, not lost with the child
        out.put(repr(exc))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="fork start method (Linux)")
def test_a_warm_call_in_a_forked_child_runs_on_the_childs_workers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    x = torch.randn(6, 8)
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):  # warm: the kept tasks and the workers' queues of this process
            wrapper(x)
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    child = ctx.Process(target=_call_in_child, args=(wrapper, x, expected, out))
    child.start()
    child.join(timeout=60)
    if child.is_alive():  # waiting on a worker of the parent's, which the child lacks
        os.kill(child.pid, 9)  # type: ignore[arg-type]
        child.join()
        pytest.fail("the call in the forked child did not return")
    result = out.get()
    assert isinstance(result, float), result
    assert result < 1e-6
