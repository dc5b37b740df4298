"""A numpy array the replicas share, written in place in forward, said at the call.

A numpy array leads to no module: every replica reads and writes that very array, so a write
one device makes once per forward (a count, a histogram, a fill from the batch) is made once
per replica, each from its chunk. An array has no write version (a tensor's is read, and a
dict's), so it was not read at the call at all: only ``check=`` compared it. Now its bytes are
read before and after each call, within a budget (``_kinds.ARRAY_BYTES``). The oracle is the
same module run plainly on one device: the write is said exactly where the replicas' array
ends up different from the oracle's, once, naming where the array is held.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.replicate._kinds import ARRAY_BYTES

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu"] * 3]


def _add_one(a: np.ndarray, x: torch.Tensor) -> None:
    a[0] += 1


def _add_at(a: np.ndarray, x: torch.Tensor) -> None:
    np.add.at(a, [0, 0], 1.0)


def _set_sum(a: np.ndarray, x: torch.Tensor) -> None:
    a[:] = float(x.sum())


def _add_out(a: np.ndarray, x: torch.Tensor) -> None:
    np.add(a, 1.0, out=a)


def _fill_rows(a: np.ndarray, x: torch.Tensor) -> None:
    a.fill(x.shape[0])


# Each way forward writes the array, from its chunk (``x``).
WRITES: dict[str, Callable[[np.ndarray, torch.Tensor], None]] = {
    "a[0] += 1": _add_one,
    "np.add.at": _add_at,
    "a[:] = x.sum()": _set_sum,
    "np.add(out=a)": _add_out,
    "a.fill(rows)": _fill_rows,
}


_ARRAYS: dict[int, np.ndarray] = {}


class Stats:
    """An object of the user's own holding the array."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class Writer(nn.Module):
    """Holds a float array where ``place`` says, and writes it in forward by ``write``."""

    def __init__(self, place: str, write: Callable[[np.ndarray, torch.Tensor], None]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.place = place
        self.write = write
        array = np.ones(3)
        if place == "attribute":
            self.hist = array
        elif place == "dict":
            self.state = {"hist": array, "name": "counts"}
        elif place == "object":
            self.stats = Stats(array)
        else:  # a forward hook of the layer that closes over it

            def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
                write(array, args[0])

            self.lin.register_forward_hook(hook)
        _ARRAYS[id(self)] = array  # (kept apart: the search would meet it anywhere on self)

    def array(self) -> np.ndarray:
        return _ARRAYS[id(self)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.place == "attribute":
            self.write(self.hist, x)
        elif self.place == "dict":
            self.write(self.state["hist"], x)
        elif self.place == "object":
            self.write(self.stats.array, x)
        return self.lin(x)


class Holds(nn.Module):
    """The writer as a child."""

    def __init__(self, inner: Writer) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _said(call: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in seen]


WHERE = {
    "attribute": "the attribute 'hist' of {m}",
    "dict": "an item of the attribute 'state' of {m}",
    "object": "an object {m} reaches",
    "hook": "a variable or attribute of the forward hook",
}


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["root", "child"])
@pytest.mark.parametrize("place", list(WHERE))
@pytest.mark.parametrize("write", list(WRITES))
def test_an_array_written_in_forward_is_said_once_where_it_differs_from_one_device(
    write: str, place: str, nested: bool, devices: list[str]
) -> None:
    """Every way of writing, wherever the array is held, on the root or a child, three CPU
    lists. Before: no word, the array off from one device's (a count of 2 per call on two
    replicas where one device has 1; the last replica's chunk sum for the batch's)."""
    made = Writer(place, WRITES[write])
    oracle = Writer(place, WRITES[write])
    model: nn.Module = Holds(made) if nested else made
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    with torch.no_grad():
        said = _said(lambda: wrapper(x))
        later = _said(lambda: [wrapper(x) for _ in range(2)])
        for _ in range(3):
            oracle(x)
    n = len(devices)
    assert later == []  # once per array
    assert len(said) == 1, said
    where = WHERE[place].format(m="module 'inner'" if nested else "the module itself")
    assert where in said[0] and f"a numpy array the {n} replicas share" in said[0], said
    # What was said happened: the array is not what one device leaves.
    assert not np.array_equal(made.array(), oracle.array()), (made.array(), oracle.array())


class Reads(nn.Module):
    """Reads its arrays (a lookup table, a mask), and is given a count by the caller between
    calls: nothing forward writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = np.linspace(0.5, 2.0, 4)
        self.seen = np.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.from_numpy(self.scale).float()


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_an_array_forward_only_reads_or_the_caller_writes_is_not_said(
    devices: list[str],
) -> None:
    model = Reads()
    wrapper = dp.DataParallel(model, devices)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            wrapper(torch.randn(6, 4))
            model.seen += 1  # (the caller's write, between calls)
            model.scale[0] += 0.25


class Large(nn.Module):
    """A table past the budget, counted in place in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = np.zeros(ARRAY_BYTES // 8 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.table[0] += 1
        return self.lin(x)


def test_an_array_past_the_budget_is_not_read_at_the_call_but_check_compares_it() -> None:
    """Past ``ARRAY_BYTES`` an array is data, not read on every call (the cost of a call does
    not grow with it); ``check=`` is where its write is said."""
    model = Large()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.DataParallel(model, ["cpu", "cpu"])(torch.randn(6, 4))
    assert model.table[0] == 2  # (written by both replicas: unsaid at the call)
    checked = dp.DataParallel(Large(), ["cpu", "cpu"], check=True)
    said = _said(lambda: checked(torch.randn(6, 4)))
    assert any("attribute table[0] after the call: 2.0 where one device has 1.0" in s for s in said)


class Spread(nn.Module):
    """Many layers, each with an array just under half the budget, each counted in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        for layer in self.layers:
            layer.counts = np.zeros(ARRAY_BYTES // 8 // 2 - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            layer.counts[0] += 1
            x = layer(x)
        return x


def test_the_budget_is_the_trees_not_each_modules() -> None:
    """Two arrays fit in the budget, the other two are data: the call reads as much whatever
    the number of modules that carry arrays."""
    model = Spread()
    said = _said(lambda: dp.DataParallel(model, ["cpu", "cpu"])(torch.randn(6, 4)))
    assert len(said) == 2, said
    assert all(layer.counts[0] == 2 for layer in model.layers)
