"""What the pass that builds a replica read is what the next call compares (issue 50, items
3 and 6): a holder that led nowhere when the replicas were built, later written to hold a
module of the tree, and a holder too large to search. Before, the hook ran on the user's module
from every replica's thread (``m.calls`` 9 for 3 calls on 3 replicas), with no warning.

The oracle is the same module run plainly: its call count, its outputs, its buffers.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel
from dataparallel.replicate._kinds import MAX_VISITS

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.calls = 0
        self.route: dict[str, Any] = {"norm": nn.Identity()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.route["norm"](self.lin(x))


def _counting_hook(holder: list[Any]) -> Any:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        for owner in holder:
            owner.calls += 1
        return out

    return hook


def _run(wrapper: dp.DataParallel, calls: int) -> None:
    x = torch.randn(6, 3)
    for _ in range(calls):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a serial run warns; the counts are the test
            wrapper(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_list_that_led_nowhere_later_holds_the_model(devices: list[str]) -> None:
    model = Net()
    holder: list[Any] = []
    model.lin.register_forward_hook(_counting_hook(holder))
    wrapper = dp.DataParallel(model, devices)
    _run(wrapper, 4)
    holder.append(model)
    _run(wrapper, 3)
    assert model.calls == 3  # once per call, as on one device


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_closure_cell_rebound_by_nonlocal(devices: list[str]) -> None:
    model = Net()
    target: Any = None

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if target is not None:
            target.calls += 1
        return out

    def point_at(value: Any) -> None:
        nonlocal target
        target = value

    model.lin.register_forward_hook(hook)
    wrapper = dp.DataParallel(model, devices)
    _run(wrapper, 4)
    point_at(model)
    _run(wrapper, 3)
    assert model.calls == 3


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_defaults_assigned_later(devices: list[str]) -> None:
    model = Net()

    def hook(module: nn.Module, args: Any, out: torch.Tensor, owner: Any = None) -> Any:
        if owner is not None:
            owner.calls += 1
        return out

    model.lin.register_forward_hook(hook)
    wrapper = dp.DataParallel(model, devices)
    _run(wrapper, 4)
    hook.__defaults__ = (model,)
    _run(wrapper, 3)
    assert model.calls == 3


def test_a_function_holders_own_part_is_compared_where_it_can_change() -> None:
    """A function without cells or keyword defaults is compared by its code and its defaults'
    tuple alone (``Held.bare``); keyword defaults set later, a tuple of defaults replaced by
    an equal one, and a code swapped are each still seen or let through as they should be."""
    from dataparallel.replicate._holders import Held
    from dataparallel.replicate._kinds import contents

    def hook(x: Any, scale: float = 1.0) -> Any:
        return x

    def other(x: Any, scale: float = 1.0) -> Any:
        return -x

    held = Held(hook, contents(hook))
    assert held.still({})
    hook.__defaults__ = (1.0,)  # another tuple, the same items: the same function
    assert held.still({})
    hook.__code__ = other.__code__
    assert not held.still({})
    hook.__code__ = held.held[0]
    assert held.still({})
    hook.__kwdefaults__ = {"owner": object()}
    assert not held.still({})


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_dict_attribute_later_routes_to_a_submodule(devices: list[str]) -> None:
    model, oracle = Net(), Net()
    wrapper = dp.DataParallel(model, devices)
    _run(wrapper, 3)
    model.route["norm"] = model.bn
    oracle.route["norm"] = oracle.bn
    _run(wrapper, 3)  # plain BatchNorm in training: per chunk, counted once per call
    assert int(model.bn.num_batches_tracked) == 3  # 9 before: once per replica and call
    model.eval()
    oracle.eval()
    oracle.bn.load_state_dict(model.bn.state_dict())
    x = torch.randn(6, 3)
    assert_close_rel(wrapper(x), oracle(x), msg="eval, through the routed BatchNorm")


class Registry:
    """A large registry a hook holds, with the model at its far end: more objects than the
    search looks into before it gets there."""

    def __init__(self, size: int, owner: nn.Module) -> None:
        # (entries that hold a holder of their own: plain records of atoms are data, skipped)
        self.entries: list[dict[str, Any]] = [{"i": [i]} for i in range(size)]
        self.entries[-1]["owner"] = owner


@pytest.mark.parametrize("devices", DEVICE_LISTS[:2], ids=str)
def test_a_holder_past_the_search_limits_runs_serially_with_a_warning(
    devices: list[str],
) -> None:
    # Before: neither rebound nor serial, and no word (the hook ran on the model from every
    # replica's thread at once).
    model = Net()
    registry = Registry(MAX_VISITS + 10, model)

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        registry.entries[-1]["owner"].calls += 1
        return out

    model.lin.register_forward_hook(hook)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match=r"too large to search") as caught:
        wrapper(x)
    message = next(str(w.message) for w in caught if "too large" in str(w.message))
    assert "forward hook" in message and "'lin'" in message, message
    assert "one after another" in message, message


# A module-level global a hook reads (issue 60, the warm call's cost): a function holder's
# globals are compared by its module dictionary's write version, its own part item by item.
_OWNER: Any = None
_TICKS = 0


def _global_hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    if _OWNER is not None:
        _OWNER.calls += 1
    return out


def _point_global_at(value: Any) -> None:
    global _OWNER
    _OWNER = value


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_global_a_hook_reads_rebound_later(devices: list[str]) -> None:
    model = Net()
    model.lin.register_forward_hook(_global_hook)
    wrapper = dp.DataParallel(model, devices)
    try:
        _run(wrapper, 4)
        _point_global_at(model)
        _run(wrapper, 3)
    finally:
        _point_global_at(None)
    assert model.calls == 3  # once per call, as on one device


def _ticking_hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    global _TICKS
    _TICKS += 1  # the module's dictionary written on every call
    return out


@pytest.mark.parametrize("devices", DEVICE_LISTS[:2], ids=str)
def test_a_global_written_each_call_then_a_cell_rebound(devices: list[str]) -> None:
    # The dictionary's version moves on every call (the holder is compared item by item then),
    # and a cell of a second hook rebound later is still seen.
    model = Net()
    target: Any = None

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if target is not None:
            target.calls += 1
        return out

    def point_at(value: Any) -> None:
        nonlocal target
        target = value

    model.lin.register_forward_hook(_ticking_hook)
    model.lin.register_forward_hook(hook)
    wrapper = dp.DataParallel(model, devices)
    _run(wrapper, 4)
    point_at(model)
    _run(wrapper, 3)
    assert model.calls == 3


class Ordered(nn.Module):
    """Its layers run in the order of an ``OrderedDict`` of its submodules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.order = collections.OrderedDict([("a", self.a), ("b", self.b)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.order.values():
            x = layer(x)
        return x


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("last", ["a", "b"])
def test_an_ordered_dict_reordered_by_move_to_end_between_calls(
    devices: list[str], last: str
) -> None:
    """``move_to_end`` writes no value and leaves a dict's write version where it was (the order
    of an ``OrderedDict`` is its own): it is compared item by item. Before, the replicas after
    the first kept the old order (rows off by up to 1.26, from the stop 74 holders' probe)."""
    model = Ordered()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(8, 4)
    with torch.no_grad():
        wrapper(x)
        for call in range(3):
            model.order.move_to_end(last if call % 2 == 0 else ("b" if last == "a" else "a"))
            assert_close_rel(wrapper(x), model(x), msg=f"call {call}")
