"""A numpy array or an iterator the replicas share, written or advanced in forward, said at
the call.

Neither leads to a module, so neither is copied for each replica: every replica writes that
very array (a count, a histogram, a fill from its chunk) and advances that very iterator
(``next(self.steps)``: a step counter, a warm-up schedule, a stream of seeds, each replica
taking a different value), where one device does it once per call. Neither has a write
version, so both were silent at the call (an array was compared only under ``check=``). Now
each is read by what shows its state, before and after each call: an array by its bytes,
within a budget (``_kinds.ARRAY_BYTES``); an iterator by where it stands
(``_kinds.place_reader``). The oracle is the same module run plainly on one device: a write is
said exactly where the replicas' object ends up other than the oracle's, once, naming where it
is held.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.replicate._kinds import ARRAY_BYTES

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu"] * 3]


def _add_at(a: np.ndarray, x: torch.Tensor) -> None:
    np.add.at(a, [0, 0], 1.0)


def _set_sum(a: np.ndarray, x: torch.Tensor) -> None:
    a[:] = float(x.sum())


def _add_one(a: np.ndarray, x: torch.Tensor) -> None:
    a[0] += 1


def _schedule() -> Iterator[float]:
    """A generator function with a variable of its own: a warm-up schedule."""
    for step in range(1_000):
        yield min(1.0, step / 100)


def _tensors(made: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """A generator whose variable is a tensor (compared by identity, never by ``==``)."""
    for value in made:  # noqa: UP028 (its variable is what is read; ``yield from`` is apart)
        yield value


def _delegating() -> Iterator[int]:
    """A generator that delegates (``yield from``): read by where what it delegates to stands."""
    yield from range(1_000)


def _delegating_to_a_generator() -> Iterator[float]:
    yield from _schedule()


def _advance(iterator: Iterator[Any], x: torch.Tensor) -> None:
    next(iterator)


# Each kind: what the module holds (made fresh), and what forward does with it and its chunk.
KINDS: dict[str, tuple[Callable[[], Any], Callable[[Any, torch.Tensor], None]]] = {
    "array: a[0] += 1": (lambda: np.ones(3), _add_one),
    "array: np.add.at": (lambda: np.ones(3), _add_at),
    "array: a[:] = x.sum()": (lambda: np.ones(3), _set_sum),
    "array: np.add(out=a)": (lambda: np.ones(3), lambda a, x: np.add(a, 1.0, out=a)),
    "array: a.fill(rows)": (lambda: np.ones(3), lambda a, x: a.fill(x.shape[0])),
    "iter(list)": (lambda: iter([0.1 * i for i in range(1_000)]), _advance),
    "iter(range)": (lambda: iter(range(1_000)), _advance),
    "itertools.count": (itertools.count, _advance),
    "generator expression": (lambda: (i * i for i in range(1_000)), _advance),
    "generator function": (_schedule, _advance),
    "generator of tensors": (
        lambda: _tensors([torch.full((3,), float(i)) for i in range(1_000)]),
        _advance,
    ),
    "yield from range": (_delegating, _advance),
    "yield from a generator": (_delegating_to_a_generator, _advance),
    "iter(numpy array)": (lambda: iter(np.linspace(0.0, 1.0, 1_000)), _advance),
    "iter(dict)": (lambda: iter({f"k{i}": i for i in range(1_000)}), _advance),
}


@pytest.fixture(autouse=True)
def _no_forced_switch() -> Iterator[None]:
    """Two replicas that meet one generator at the same moment make the second raise
    "generator already executing" (said with the replica, as any error in a replica is): a
    thread holding the GIL inside a generator's step can be made to let it go there when
    another has waited for it a switch interval. These generators' steps release the GIL
    nowhere of their own, so with a long interval no replica is ever stopped inside one, and
    the test does not depend on the scheduler."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    yield
    sys.setswitchinterval(before)


class Box:
    """An object of the user's own holding the state."""

    def __init__(self, held: Any) -> None:
        self.held = held


_HELD: dict[int, Any] = {}


class Carrier(nn.Module):
    """Holds ``make()`` where ``place`` says, and has forward ``act`` on it with its chunk."""

    def __init__(
        self, place: str, make: Callable[[], Any], act: Callable[[Any, torch.Tensor], None]
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.place = place
        self.act = act
        held = make()
        if place == "attribute":
            self.held = held
        elif place == "dict":
            self.state = {"held": held, "name": "counts"}
        elif place == "object":
            self.box = Box(held)
        else:  # a forward pre-hook of the layer that closes over it

            def hook(module: nn.Module, args: Any) -> None:
                act(held, args[0])

            self.lin.register_forward_pre_hook(hook)
        _HELD[id(self)] = held  # (kept apart: the search would meet it anywhere on self)

    def carried(self) -> Any:
        return _HELD[id(self)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.place == "attribute":
            self.act(self.held, x)
        elif self.place == "dict":
            self.act(self.state["held"], x)
        elif self.place == "object":
            self.act(self.box.held, x)
        return self.lin(x)


class Holds(nn.Module):
    """The carrier as a child."""

    def __init__(self, inner: nn.Module) -> None:
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
    "attribute": "the attribute 'held' of {m}",
    "dict": "an item of the attribute 'state' of {m}",
    "object": "an object {m} reaches",
    "hook": "a variable or attribute of the forward pre-hook",
}


def _state(held: Any) -> np.ndarray:
    """What shows the state: an array itself, an iterator's next value."""
    return held.copy() if isinstance(held, np.ndarray) else np.asarray(next(held))


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["root", "child"])
@pytest.mark.parametrize("place", list(WHERE))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_write_to_shared_data_in_forward_is_said_once_where_it_differs_from_one_device(
    kind: str, place: str, nested: bool, devices: list[str]
) -> None:
    """Every kind, wherever it is held, on the root or a child, three CPU lists. Before: no
    word, and the array off from one device's (a count of 2 per call on two replicas where one
    device has 1; the last replica's chunk sum for the batch's), the iterator ahead of one
    device's by one value per further replica per call."""
    make, act = KINDS[kind]
    made, oracle = Carrier(place, make, act), Carrier(place, make, act)
    model: nn.Module = Holds(made) if nested else made
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    with torch.no_grad():
        said = _said(lambda: wrapper(x))
        later = _said(lambda: [wrapper(x) for _ in range(2)])
        for _ in range(3):
            oracle(x)
    n = len(devices)
    assert later == []  # once per object
    assert len(said) == 1, said
    where = WHERE[place].format(m="module 'inner'" if nested else "the module itself")
    assert where in said[0] and f"the {n} replicas share" in said[0], said
    if kind.startswith("array"):
        assert "a numpy array the" in said[0]
    ours = _state(made.carried())
    # What was said happened: not what one device leaves; an iterator 3 * n values on.
    assert not np.array_equal(ours, _state(oracle.carried())), ours
    if not kind.startswith("array"):
        reference = make()
        for _ in range(3 * n):
            next(reference)
        assert np.array_equal(ours, _state(reference))


class Reads(nn.Module):
    """Reads its arrays (a lookup table) and holds iterators it never advances; the caller
    writes and advances them between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = np.linspace(0.5, 2.0, 4)
        self.seen = np.zeros(1)
        self.steps = itertools.count()
        self.schedule = _schedule()
        self.order = iter(range(100))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.from_numpy(self.scale).float()


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_what_forward_only_reads_or_the_caller_writes_is_not_said(devices: list[str]) -> None:
    model = Reads()
    wrapper = dp.DataParallel(model, devices)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            wrapper(torch.randn(6, 4))
            model.seen += 1
            model.scale[0] += 0.25
            next(model.steps), next(model.schedule), next(model.order)


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
