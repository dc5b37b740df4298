"""The wrapper's last warm call (``PlanCache.warm``, read by ``_warm.run_call``): a call served
from it is the call the full look-up would serve, and anything the look-up or ``warm_step``
reads, changed between two calls (in place too), is seen at the next call."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel


def warm_wrapper() -> tuple[nn.Module, dp.DataParallel, torch.Tensor]:
    """A small model, its two-replica wrapper after three identical (warm) calls, the input."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    w = dp.DataParallel(m, device_ids=["cpu", "cpu"])
    x = torch.randn(8, 4)
    for _ in range(3):
        w(x)
    return m, w, x


def sizes(w: dp.DataParallel) -> list[int]:
    return list(w.last_call.chunk_sizes)


def test_options_and_devices_changed_in_place_are_seen_by_the_next_call() -> None:
    m, w, x = warm_wrapper()
    assert sizes(w) == [4, 4]
    w.options["weights"] = (3, 1)  # the dict changed in place
    assert_close_rel(w(x), m(x))
    assert sizes(w) == [6, 2]
    w.options["weights"] = None
    w(x)
    assert sizes(w) == [4, 4]
    w.device_ids.append(torch.device("cpu"))  # the list changed in place
    assert_close_rel(w(x), m(x))
    assert len(sizes(w)) == 3
    w.device_ids.pop()
    w(x)
    assert sizes(w) == [4, 4]


def test_a_forward_replaced_or_a_module_swapped_is_seen_by_the_next_call() -> None:
    m, w, x = warm_wrapper()
    seen: list[Any] = []

    def forward(t: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        seen.append(num_items_in_batch)
        return m[2](m[1](m[0](t)))

    m.forward = forward  # type: ignore[method-assign]
    assert_close_rel(w(x), m[2](m[1](m[0](x))))
    assert len(seen) == 2  # the new forward runs, once per replica
    del m.forward
    other = nn.Sequential(nn.Linear(4, 3))
    w.module = other
    assert_close_rel(w(x), other(x))


def test_an_own_replicate_set_later_is_seen_by_the_next_call() -> None:
    m, w, x = warm_wrapper()
    calls: list[int] = []
    real = w.replicate

    def replicate(module: nn.Module, device_ids: Any) -> list[nn.Module]:
        calls.append(1)
        return real(module, device_ids)

    w.replicate = replicate  # type: ignore[method-assign]
    assert_close_rel(w(x), m(x))
    assert calls


def test_a_tensor_replaced_off_the_device_between_warm_calls_is_named() -> None:
    """The sentinels, read inline by the warm entry, see the module's last tensor (a buffer
    forward does not read, so nothing else would) replaced by one on another device."""
    m = nn.Sequential(nn.Linear(4, 3))
    m[0].register_buffer("scale", torch.ones(3))  # the last tensor: a sentinel
    w = dp.DataParallel(m, device_ids=["cpu", "cpu"])
    x = torch.randn(8, 4)
    for _ in range(3):
        w(x)
    m[0].scale = torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match=r"'0\.scale' on the meta device"):
        w(x)
    m[0].scale = torch.ones(3)
    assert_close_rel(w(x), m(x))
