"""An iterator the replicas share, advanced in forward, said at the call.

An iterator of the language (a list's or range's iterator, ``itertools.count``, a generator)
leads to no module: every replica advances that very iterator, so a forward that takes one
value per call (``next(self.steps)``: a step counter, a schedule, a stream of seeds) takes one
per replica, each replica a different value, where one device takes one for the whole batch.
It has no version and no attributes to read, so it was silent. Now each is read by where it
stands (``_kinds.place_reader``), before and after each call. The oracle is the same module
run plainly on one device: the advance is said exactly where the replicas' iterator ends up
further on than the oracle's, once, naming where it is held.
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

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu"] * 3]


def _schedule() -> Iterator[float]:
    """A generator function with a variable of its own: a warm-up schedule."""
    for step in range(1_000):
        yield min(1.0, step / 100)


def _tensors(made: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """A generator whose variable is a tensor (compared by identity, never by ``==``)."""
    for value in made:  # noqa: UP028 (its variable is what is read; ``yield from`` is apart)
        yield value


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


def _delegating() -> Iterator[int]:
    """A generator that delegates (``yield from``): read by where what it delegates to stands."""
    yield from range(1_000)


def _delegating_to_a_generator() -> Iterator[float]:
    yield from _schedule()


# Each iterator a forward may advance, made fresh.
ITERATORS: dict[str, Callable[[], Iterator[Any]]] = {
    "iter(list)": lambda: iter([0.1 * i for i in range(1_000)]),
    "iter(range)": lambda: iter(range(1_000)),
    "itertools.count": itertools.count,
    "generator expression": lambda: (i * i for i in range(1_000)),
    "generator function": _schedule,
    "generator of tensors": lambda: _tensors([torch.full((3,), float(i)) for i in range(1_000)]),
    "yield from range": _delegating,
    "yield from a generator": _delegating_to_a_generator,
    "iter(numpy array)": lambda: iter(np.linspace(0.0, 1.0, 1_000)),
    "iter(dict)": lambda: iter({f"k{i}": i for i in range(1_000)}),
}


class Stream:
    """An object of the user's own holding the iterator."""

    def __init__(self, values: Iterator[Any]) -> None:
        self.values = values


_HELD: dict[int, Iterator[Any]] = {}


class Advancer(nn.Module):
    """Holds an iterator where ``place`` says, and takes one value from it per forward."""

    def __init__(self, place: str, make: Callable[[], Iterator[Any]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.place = place
        values = make()
        if place == "attribute":
            self.steps = values
        elif place == "dict":
            self.state = {"steps": values, "name": "schedule"}
        elif place == "object":
            self.stream = Stream(values)
        else:  # a forward pre-hook of the layer that closes over it

            def hook(module: nn.Module, args: Any) -> None:
                next(values)

            self.lin.register_forward_pre_hook(hook)
        _HELD[id(self)] = values  # (kept apart: the search would meet it anywhere on self)

    def held(self) -> Iterator[Any]:
        return _HELD[id(self)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.place == "attribute":
            next(self.steps)
        elif self.place == "dict":
            next(self.state["steps"])
        elif self.place == "object":
            next(self.stream.values)
        return self.lin(x)


class Holds(nn.Module):
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
    "attribute": "the attribute 'steps' of {m}",
    "dict": "an item of the attribute 'state' of {m}",
    "object": "an object {m} reaches",
    "hook": "a variable or attribute of the forward pre-hook",
}


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["root", "child"])
@pytest.mark.parametrize("place", list(WHERE))
@pytest.mark.parametrize("kind", list(ITERATORS))
def test_an_iterator_advanced_in_forward_is_said_once_where_it_runs_ahead_of_one_device(
    kind: str, place: str, nested: bool, devices: list[str]
) -> None:
    """Every kind, wherever it is held, on the root or a child, three CPU lists. Before: no
    word, and the iterator ran ahead of one device's by one value per further replica per
    call."""
    made = Advancer(place, ITERATORS[kind])
    oracle = Advancer(place, ITERATORS[kind])
    model: nn.Module = Holds(made) if nested else made
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    with torch.no_grad():
        said = _said(lambda: wrapper(x))
        later = _said(lambda: [wrapper(x) for _ in range(2)])
        for _ in range(3):
            oracle(x)
    n = len(devices)
    assert later == []  # once per iterator
    assert len(said) == 1, said
    where = WHERE[place].format(m="module 'inner'" if nested else "the module itself")
    assert where in said[0] and f"the {n} replicas share" in said[0], said
    # What was said happened: 3 calls took 3 * n values, where one device took 3.
    reference = ITERATORS[kind]()
    for _ in range(3 * n):
        next(reference)
    ours, expected = next(made.held()), next(reference)
    assert ours is expected or bool(np.all(np.asarray(ours) == np.asarray(expected)))
    assert not bool(np.all(np.asarray(next(oracle.held())) == np.asarray(ours)))


class Reads(nn.Module):
    """Holds iterators forward never advances; the caller takes from them between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = itertools.count()
        self.schedule = _schedule()
        self.order = iter(range(100))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_an_iterator_only_the_caller_advances_is_not_said(devices: list[str]) -> None:
    model = Reads()
    wrapper = dp.DataParallel(model, devices)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            wrapper(torch.randn(6, 4))
            next(model.steps), next(model.schedule), next(model.order)
