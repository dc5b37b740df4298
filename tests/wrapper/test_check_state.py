"""``check=`` compares the module's plain state too (issue 60: writes nothing can watch).

A numpy array written in place, a count, a list, a dict or a tuple kept as an attribute has no
version counter: the replicas' writes to it (each replica's to a shared array, replica 0's
chunk's to a count) cannot be seen at the call, and were silent even under ``check=``, which
compared only parameters and buffers. Each case writes one kind of state in forward, on the
root or a child, on three CPU lists. The oracle is the same call on a copy of the module on
one device, made before each call: ``check=`` must report the attribute exactly when its value
differs from the oracle's, naming the place inside it.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp

DEVICES = [["cpu", "cpu"], ["cpu"] * 3, ["cpu:1", "cpu:1"]]

# kind -> (the state before the first call, its write in forward, the place reported inside)
KINDS: dict[str, tuple[Callable[[], Any], Callable[[Any, torch.Tensor], Any], str]] = {
    "numpy written in place": (lambda: np.zeros(3), lambda s, x: s.__iadd__(1.0), "[0]"),
    "count of samples": (lambda: 0, lambda s, x: s + x.shape[0], ""),
    "count of calls": (lambda: 0, lambda s, x: s + 1, ""),
    "list appended to": (list, lambda s, x: s.append(1) or s, ""),
    "dict of counts": (lambda: {"n": 0}, lambda s, x: {"n": s["n"] + x.shape[0]}, "['n']"),
    "tuple of the shape": (tuple, lambda s, x: tuple(x.shape), "[0]"),
    "float statistic": (lambda: 0.0, lambda s, x: float(x.abs().mean()), ""),
    "string": (str, lambda s, x: "seen", ""),
    "None or an array by the batch's size": (
        lambda: None,
        lambda s, x: None if x.shape[0] < 6 else np.ones(3),
        "",
    ),
    "numpy of the chunk's rows": (
        lambda: np.zeros(1),
        lambda s, x: np.array([float(x.shape[0])]),
        "[0]",
    ),
}


class Holder(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.state = KINDS[kind][0]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state = KINDS[self.kind][1](self.state, x)
        return x


class Net(nn.Module):
    def __init__(self, kind: str, child: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.inner = Holder(kind) if child else None
        if not child:
            self.kind = kind
            self.state = KINDS[kind][0]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            return self.lin(self.inner(x))
        return self.lin(Holder.forward(self, x))  # type: ignore[arg-type]


def _same(a: Any, b: Any) -> bool:
    """The test's own comparison: equal values, floats within 1e-6 relative."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-6, atol=0))
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return bool(a == b)


@pytest.mark.parametrize("devices", DEVICES, ids=str)
@pytest.mark.parametrize("child", [False, True], ids=["root", "child"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_plain_state_is_reported_where_it_differs_from_one_device(
    devices: list[str], child: bool, kind: str
) -> None:
    model = Net(kind, child)
    wrapper = dp.DataParallel(model, devices, check=True)
    wrapper.check_every = 1
    holder = model.inner if child else model
    bare = f"attribute {'inner.' if child else ''}state"
    place = f"{bare}{KINDS[kind][2]}"
    differs = []
    reported: list[str] = []
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(6, 4, generator=gen)
        oracle = copy.deepcopy(model)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            wrapper(x)
        with torch.no_grad():
            oracle(x)
        theirs = oracle.inner.state if child else oracle.state
        differs.append(not _same(holder.state, theirs))
        reported += [str(w.message) for w in said if issubclass(w.category, dp.OneDeviceDifference)]
    assert len(set(differs)) == 1, differs  # (each call the same way)
    if differs[0]:
        assert len(reported) == 1, reported  # (once per place)
        # (the place inside, or the attribute itself where replica 0 is a copy, whose stored
        # tuple is dropped, as the guide says: "0 items where one device has 2")
        head = "check=: differs from one device: "
        assert reported[0].startswith((f"{head}{place} after", f"{head}{bare} after")), reported
        assert "compute it from the wrapper's output after the call" in reported[0]
    else:
        assert reported == [], reported


def test_large_equal_arrays_and_nans_are_not_reported() -> None:
    """An array that forward does not write, NaNs included, and one written the same way by
    one device and the replicas (replica 0 sets it from the call, not the chunk)."""

    class Carrier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.table = np.full((1000, 16), np.nan)
            self.table[::2] = 1.5
            self.step = np.zeros(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.step = self.step + 1
            return self.lin(x)

    wrapper = dp.DataParallel(Carrier(), ["cpu", "cpu"], check="raise")
    wrapper.check_every = 1
    for _ in range(2):
        wrapper(torch.randn(6, 4))


class Keyed(nn.Module):
    """State keyed by objects of the tree: a dict from each module to its name (a hook's
    lookup, issue 60 item 5), a set of modules, a dict keyed by tensors; the copy holds
    copies of them, equal to none of the module's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.names = {m: n for n, m in self.named_modules()}
        self.layers = set(self.children())
        self.scales = {self.lin.weight: 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * len(self.names) * len(self.layers) * len(self.scales)


@pytest.mark.parametrize("devices", DEVICES, ids=str)
def test_state_keyed_by_the_trees_objects_is_compared_by_position(devices: list[str]) -> None:
    """Before, the keys were compared by ``==``, and every key of the module's dict differed
    from the copy's: "keys only here" was reported for a lookup no forward wrote, and a set
    of modules "differed" the same way."""
    wrapper = dp.DataParallel(Keyed(), devices, check="raise")
    wrapper.check_every = 1
    for _ in range(2):
        wrapper(torch.randn(6, 4))
