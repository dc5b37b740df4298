"""State a replica's ``__dict__`` copy does not hold (issue 50, items 5 and 7): a module's
``__slots__``, and an object a hook holds whose ``__getstate__`` leaves something out. Before,
replica 1 raised "'Slotted' object has no attribute 'scale'" and "'Logger' object has no
attribute 'lock'", or kept a slot's old value after it was written; each case is the same
module on one device."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


class Slotted(nn.Module):
    __slots__ = ("__private", "scale")

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.scale = 2.0
        self.__private = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.__private

    def set_private(self, value: float) -> None:
        self.__private = value


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_modules_slots_reach_every_replica_on_every_call(devices: list[str]) -> None:
    model = Slotted()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 3)
    assert_close_rel(wrapper(x), model(x))
    model.scale = 3.0  # a slot written between calls: no __dict__ write to see
    model.set_private(-1.0)
    assert_close_rel(wrapper(x), model(x), msg="after the slots were written")
    del model.scale  # unset on the module: unset on the replicas, the same error
    with pytest.raises(AttributeError, match="scale"):
        model(x)
    with pytest.raises(Exception, match="scale"):
        wrapper(x)


class Logger:
    """A hook object that holds a lock and leaves it out of its pickled state."""

    def __init__(self, owner: nn.Module) -> None:
        self.lock = threading.Lock()
        self.owner = owner
        self.calls = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["lock"]
        return state

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.calls += 1
        return out * self.owner.gain


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(3, 3)
        self.gain = 2.0
        self.lin.register_forward_hook(Logger(self))  # holds the module: rebuilt per replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_hook_objects_state_left_out_of_its_pickle_is_kept(devices: list[str]) -> None:
    model = Net()
    x = torch.randn(6, 3)
    want = model(x)
    assert_close_rel(dp.DataParallel(model, devices)(x), want)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Gain:
    """A hook object with a slot beside its ``__dict__``; it holds the model (rebound)."""

    __slots__ = ("__dict__", "gain")

    def __init__(self, owner: nn.Module) -> None:
        self.owner = owner
        self.gain = 2.0

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * self.gain + self.owner.bias


class Tripled(Gain):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 3.0 + self.owner.bias


@pytest.mark.parametrize("how", ["slot", "class"])
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_copied_holders_slot_or_class_written_reaches_every_replica(
    devices: list[str], how: str
) -> None:
    # Issue 50, item 5: replicas 1+ kept the old value (0.67 relative).
    model = Scaled()
    gain = Gain(model)
    model.lin.register_forward_hook(gain)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 3)
    assert_close_rel(wrapper(x), model(x))
    if how == "slot":
        gain.gain = 5.0
    else:
        gain.__class__ = Tripled
    for call in range(2):
        assert_close_rel(wrapper(x), model(x), msg=f"{how} written, call {call}")


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_rebound_hooks_code_swapped_reaches_every_replica(devices: list[str]) -> None:
    # Issue 50, item 4: `h.__code__ = other.__code__`; replicas 1+ kept the old code.
    model = Scaled()

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 2.0 + model.bias

    def other(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * -3.0 + model.bias

    model.lin.register_forward_hook(hook)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 3)
    assert_close_rel(wrapper(x), model(x))
    hook.__code__ = other.__code__
    for call in range(2):
        assert_close_rel(wrapper(x), model(x), msg=f"code swapped, call {call}")
