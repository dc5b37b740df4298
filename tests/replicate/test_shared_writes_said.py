"""Writes to a holder the replicas share, said at the call (stop 74's holders probe).

A holder that leads to no module of the tree (a hook's history list, a stats dict, a
``Counter``) is not copied for each replica: every replica reads and writes that very object,
so a write one device makes once per forward is made once per replica that reaches it. It
cannot be taken back; it is said, once per holder, at the first call that makes it. The oracle
is the same module run plainly: the counts on one device, and no warning where forward only
reads what it carries.
"""

from __future__ import annotations

import collections
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu"] * 3]


class Logged(nn.Module):
    """A model that counts its calls in a stats dict, by name in a ``Counter``, and logs each
    forward of its layer through a hook into a list."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.stats = {"calls": 0}
        self.by_name: collections.Counter[str] = collections.Counter()
        self.vocab = {f"w{i}": i for i in range(300)}  # read only
        history: list[dict[str, int]] = []
        self.lin.register_forward_hook(lambda m, a, out: history.append({"rows": out.shape[0]}))
        self.history = history  # (the same list: said once, by the first name found)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats["calls"] += 1
        self.by_name["forward"] += 1
        return self.lin(x) * len(self.vocab)


def _said(call: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_shared_holder_written_in_forward_is_said_once_at_the_first_call(
    devices: list[str],
) -> None:
    """Before, the counts doubled with no word: ``stats["calls"]`` 2 per call on two
    replicas, the history two records per call."""
    model, oracle = Logged(), Logged()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    with torch.no_grad():
        said = _said(lambda: wrapper(x))
        oracle(x)
        later = _said(lambda: [wrapper(x) for _ in range(3)])
    assert later == []  # once per holder
    n = len(devices)
    for name, kind in (("stats", "dict"), ("by_name", "Counter"), ("history", "list")):
        found = f"the attribute '{name}' of the module itself, a {kind} the {n} replicas share"
        assert sum(found in s for s in said) == 1, (found, said)
    assert len(said) == 3, said
    # What was said is what happened: one write per replica, where one device makes one.
    assert model.stats["calls"] == n * 4 and oracle.stats["calls"] == 1
    assert len(model.history) == n * 4 and len(oracle.history) == 1


class Reader(nn.Module):
    """Reads what it carries (a vocabulary, a table of records) and writes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.vocab = collections.OrderedDict((f"w{i}", i) for i in range(50_000))
        self.records = [{"id": i, "name": f"r{i}"} for i in range(1_000)]
        self.order = [self.lin]  # leads to the tree: copied for each replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.order:
            x = layer(x)
        return x * (len(self.vocab) + len(self.records))


class Cached(nn.Module):
    """A plain tensor attribute counted in place, and a preallocated cache (a tensor in a
    list) each forward writes its rows into: every replica writes the same tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.count = torch.zeros(())
        self.cache = [torch.zeros(8, 4)]
        self.mask = torch.ones(4)  # read only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.cache[0][: x.shape[0]] = x
        return self.lin(x) * self.mask


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_shared_tensor_written_in_place_in_forward_is_said(devices: list[str]) -> None:
    """Read by its version counter, before and after the replicas ran. Before, ``count`` went
    up by one per replica per call, and the replicas' rows raced in the cache, unsaid."""
    model, oracle = Cached(), Cached()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    with torch.no_grad():
        said = _said(lambda: wrapper(x))
        oracle(x)
    n = len(devices)
    assert len(said) == 2, said
    assert any(f"the attribute 'count' of the module itself, a Tensor the {n}" in s for s in said)
    assert any("an item of the attribute 'cache' of the module itself, a Tensor" in s for s in said)
    assert float(model.count) == n and float(oracle.count) == 1  # what was said happened


class Teacher(nn.Module):
    """An EMA teacher written in forward through the module, with a view of its weight kept
    as a plain attribute: replica 0 writes the module's weight once, the others their own
    copy-on-write clones; nothing the replicas share is written."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4).requires_grad_(False)
        self.first_row = self.teacher.weight[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.teacher.weight.mul_(0.5).add_(self.student.weight, alpha=0.5)
        return self.student(x) + self.teacher(x)


@pytest.mark.parametrize("make", [Reader, Teacher], ids=lambda c: c.__name__)
def test_a_forward_that_writes_nothing_the_replicas_share_is_not_said(
    make: type[nn.Module],
) -> None:
    """A forward that only reads what it carries, or writes a frozen parameter of the module
    (each replica its own: replica 0 the module's, once), makes no shared write to say."""
    wrapper = dp.DataParallel(make(), ["cpu", "cpu"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            wrapper(torch.randn(6, 4))


CALLS = 0  # a script's counter, rebound by a ``global`` statement in forward


class Counted(nn.Module):
    """Counts its calls in its forward hook's own variable (``nonlocal``) and in a module-level
    name its forward rebinds (``global``): both the replicas share, both each replica writes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        hooked = 0

        def count_rows(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            nonlocal hooked
            hooked += 1

        self.lin.register_forward_hook(count_rows)

    def hooked(self) -> int:
        """The hook's count (read from its cell: a getter closing over it would be a second
        function the replicas share, said apart)."""
        (hook,) = self.lin._forward_hooks.values()
        return int(hook.__closure__[0].cell_contents)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global CALLS
        CALLS += 1
        return self.lin(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_variable_a_hook_or_forward_rebinds_is_said(devices: list[str]) -> None:
    """Before, a ``nonlocal`` or ``global`` counter went up once per replica per call with no
    word (a function was never read after the call)."""
    global CALLS
    model, oracle = Counted(), Counted()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    CALLS = 0
    with torch.no_grad():
        said = _said(lambda: wrapper(x))
        later = _said(lambda: wrapper(x))
    ours, CALLS = CALLS, 0
    oracle(x)
    assert later == []  # once per holder
    assert len(said) == 2, said
    assert any(
        "a variable or attribute of the forward hook" in s and "count_rows of module 'lin'" in s
        for s in said
    )
    assert any(
        "a variable or attribute of the forward Counted.forward of the module itself" in s
        for s in said
    )
    n = len(devices)  # what was said is what happened
    assert model.hooked() == 2 * n and oracle.hooked() == 1
    assert ours == 2 * n and CALLS == 1


def tally(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    """A forward hook that counts its calls in an attribute of its own."""
    tally.calls += 1


def tally_by(step: int, module: nn.Module, args: Any, out: torch.Tensor) -> None:
    """The same, by ``step``, registered as a ``functools.partial``."""
    tally_by.calls += step


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("kind", ["function", "partial"])
def test_an_attribute_a_hook_writes_on_itself_is_said(kind: str, devices: list[str]) -> None:
    """A hook's ``tally.calls += 1`` goes up once per replica per call; said once, with the
    hook named (a partial by the function it wraps). Before: no word (a function's attributes
    were not read after the call)."""
    func = tally if kind == "function" else tally_by
    hook = tally if kind == "function" else functools.partial(tally_by, 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].register_forward_hook(hook)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    func.calls = 0
    with torch.no_grad():
        said = _said(lambda: wrapper(x))
        later = _said(lambda: wrapper(x))
    assert later == [] and len(said) == 1, said
    name = "tally" if kind == "function" else "functools.partial(tally_by)"
    assert f"a variable or attribute of the forward hook {name} of module '0'" in said[0]
    assert func.calls == 2 * len(devices)  # (what was said is what happened)


class Steps(nn.Module):
    """A user's base class whose subclass counts its calls in a class attribute."""

    calls = 0
    name = "steps"  # read only


class Stepped(Steps):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1  # (on ``Stepped``: the subclass's own from the first write)
        return self.lin(x) * len(self.name)


class HoldsStepped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Stepped()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("where", ["root", "child"])
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_class_attribute_written_in_forward_is_said(devices: list[str], where: str) -> None:
    """A class is one object for every replica: ``type(self).calls += 1`` is made once per
    replica, where one device makes it once per call (silent on 9727e1c). Said once, naming
    the class attribute; the count is what it is, one per replica per call."""
    Stepped.calls = Steps.calls = 0
    net: nn.Module = Stepped() if where == "root" else HoldsStepped()
    model = dp.DataParallel(net, devices)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(6, 4))
    said = [str(w.message) for w in caught if "class attribute" in str(w.message)]
    where_said = "the module itself" if where == "root" else "module 'inner'"
    assert said == [
        f"module: forward wrote the class attribute Stepped.calls (of the class of "
        f"{where_said}), a class the {len(devices)} replicas share (it leads to no module, so "
        f"it is not copied for each): every replica that reaches it wrote it, so a write one "
        f"device makes once per forward (an append, a count) was made up to {len(devices)} "
        f"times in this call, each from its replica's chunk. To keep one write per call, make "
        f"it from the wrapper's output after the call, or keep the state in a tensor buffer "
        f"(written once per call, from replica 0's chunk)"
    ], said
    assert Stepped.calls == 3 * len(devices) and Steps.calls == 0
