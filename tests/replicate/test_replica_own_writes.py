"""A replica's own write, made where the module wrote nothing, does not outlive its call.

Replica 0 is the module; what a later replica's forward writes on itself is dropped (the guide,
"A forward that writes its own state"). A write that only some chunk makes (a flag raised by a
sample) can come from a later replica alone: the module is then unwritten, so no snapshot of it
asks for a refill, and the replica used to keep its write into the next calls, computing its
chunk from state no device holds. Each case below raises such a flag in replica 1's chunk only,
then checks that the next calls compute every row from the module as it stands, as one device
running that module does (the oracle), that the flag's write stays off the module, and that the
flagged call says so (one device would have written the module), naming what was written.

The family: what is written (a plain attribute set, one deleted back to its class's value, a
buffer reassigned, a child replaced, a hook registered, a parameter swapped through
``_parameters``), on which module of the tree (the root or a child), on three CPU lists, read
by write stamps and by the comparison CPython 3.10 falls back to.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.replicate import _own
from dataparallel.replicate._replicas import Replicas

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu", "cpu"]]


def _set_attribute(m: nn.Module) -> None:
    m.mode = 5.0


def _delete_attribute(m: nn.Module) -> None:
    del m.mode  # the class's value (1.0) shows from then on


def _reassign_buffer(m: nn.Module) -> None:
    m.offset = m.offset + 5.0


def _replace_child(m: nn.Module) -> None:
    m.act = nn.Sigmoid()


def _register_hook(m: nn.Module) -> None:
    m.act.register_forward_hook(lambda _m, _i, out: out + 5.0)


def _swap_parameter(m: nn.Module) -> None:
    m.lin._parameters["bias"] = nn.Parameter(m.lin.bias.detach() + 5.0)


def _set_tensor(m: nn.Module) -> None:
    m.scale = torch.full((3,), 5.0)  # a plain tensor attribute: not a buffer


# What the warning names for each kind of write.
SAID = {
    "attribute": "mode = 5.0 (the module keeps 2.0)",
    "deleted": "del mode",
    "buffer": "a buffer",
    "child": "a child module",
    "hook": "a hook",
    "parameter": "a parameter",
    "tensor": "scale (a Tensor)",
}

# The writes made on a child of the block: said of that child.
WHERE = {"hook": ".act", "parameter": ".lin"}

WRITES: dict[str, Callable[[nn.Module], None]] = {
    "attribute": _set_attribute,
    "deleted": _delete_attribute,
    "buffer": _reassign_buffer,
    "child": _replace_child,
    "hook": _register_hook,
    "parameter": _swap_parameter,
    "tensor": _set_tensor,
}


class Block(nn.Module):
    """Reads every kind of state the writes change; writes one kind when its chunk holds a
    flagged sample (first feature over 100)."""

    mode = 1.0  # (the class's value, under the instance's)

    def __init__(self, write: Callable[[nn.Module], None], count: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.act = nn.Tanh()
        self.mode = 2.0
        self.scale = torch.ones(3)
        self.register_buffer("offset", torch.zeros(3))
        self.write = write
        self.count = count  # whether every chunk steps a counter: every replica writes
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.lin(x.clamp(max=1.0))) * self.mode * self.scale + self.offset
        if self.count:
            self.calls += 1
        if bool((x[:, 0] > 100).any()):
            self.write(self)
        return out


class Outer(nn.Module):
    """The same block one level down: the write lands on a child's replica."""

    def __init__(self, write: Callable[[nn.Module], None], count: bool = False) -> None:
        super().__init__()
        self.inner = Block(write, count)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


@pytest.fixture(params=["stamps", "compared"])
def watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the replicas' tables are read: by write stamps where the interpreter has them, or
    by comparing every entry (CPython 3.10, or stamps that cannot be read)."""
    if request.param == "compared":
        monkeypatch.setattr(_own, "stamps", lambda *_a, **_k: None)
    return str(request.param)


@pytest.mark.parametrize("count", [False, True], ids=["alone", "counted"])
@pytest.mark.parametrize("where", ["root", "child"])
@pytest.mark.parametrize("kind", list(WRITES))
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=["shared", "copied", "three"])
def test_a_later_replicas_own_write_is_gone_at_the_next_call(
    devices: list[str], kind: str, where: str, count: bool, watch: str
) -> None:
    """``counted``: every replica steps a counter on the same module too, so the module was
    written in the flagged call (by replica 0), though not where the later replica wrote."""
    torch.manual_seed(0)
    net: nn.Module = Block(WRITES[kind], count) if where == "root" else Outer(WRITES[kind], count)
    before = copy.deepcopy(net)
    model = dp.DataParallel(net, devices)
    flagged = torch.rand(6, 3)
    flagged[-1, 0] = 1000.0  # the last chunk's: a later replica's alone
    path = ("module" if where == "root" else "module.inner") + WHERE.get(kind, "")
    plain = torch.rand(6, 3)
    for call, x in enumerate((flagged, plain, plain + 1.0)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            out = model(x)
        if call:  # (not the oracle on the flagged batch: it would write itself)
            torch.testing.assert_close(out, before(x))
        ours = [str(w.message) for w in said if "wrote its own state" in str(w.message)]
        if call:
            assert ours == []
        else:  # said at the call that wrote
            assert len(ours) == 1, ours
            writer = len(devices) - 1
            assert ours[0].startswith(f"{path}: replica {writer}'s forward wrote its own state")
            assert SAID[kind] in ours[0]
            assert "calls =" not in ours[0]  # (every replica wrote it: the module did too)
    # nothing of the flag's write reached the module
    theirs = before.state_dict()
    assert list(net.state_dict()) == list(theirs)
    for name, mine in net.state_dict().items():
        torch.testing.assert_close(mine, theirs[name], msg=name)
    block = net if where == "root" else net.inner
    assert block.__dict__["mode"] == 2.0 and torch.equal(block.scale, torch.ones(3))
    assert block.calls == (3 if count else 0)
    assert type(block.act) is nn.Tanh and not block.act._forward_hooks


def test_only_the_module_whose_replica_wrote_is_refilled(
    watch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Outer(_set_attribute)
    model = dp.DataParallel(net, ["cpu", "cpu"])
    model(torch.rand(4, 3))  # (a set kept, its replicas watched)
    fills: list[list[int] | None] = []
    fill = Replicas._fill

    def spy(self: Replicas, root: nn.Module, buffers: Any, only: Any, search: Any) -> None:
        fills.append(None if only is None else list(only))
        fill(self, root, buffers, only, search)

    monkeypatch.setattr(Replicas, "_fill", spy)
    flagged = torch.rand(4, 3)
    flagged[-1, 0] = 1000.0
    model(flagged)
    assert fills == []  # the module was not written
    model(torch.rand(4, 3))
    names = [name for name, _ in net.named_modules()]
    assert [[names[i] for i in only or ()] for only in fills] == [["inner"]]
    model(torch.rand(4, 3))
    assert len(fills) == 1  # nothing written since


class EveryChunk(nn.Module):
    """Writes on every replica: a counter every call, a flag when its chunk holds a flagged
    sample (replica 0's chunk too, below)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0
        self.flag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x.clamp(max=1.0)) * (2.0 if self.flag else 1.0)
        self.calls += 1
        if bool((x[:, 0] > 100).any()):
            self.flag = True
        return out


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=["shared", "copied", "three"])
def test_writes_the_module_got_too_are_not_said(devices: list[str], watch: str) -> None:
    # replica 0 (the module) made the same writes: it holds what one device holds
    net = EveryChunk()
    model = dp.DataParallel(net, devices)
    flagged = torch.rand(6, 3)
    flagged[0, 0] = flagged[-1, 0] = 1000.0  # in replica 0's chunk and the last one's
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for call, x in enumerate((flagged, torch.rand(6, 3), torch.rand(6, 3))):
            out = model(x)
            torch.testing.assert_close(out, net.lin(x.clamp(max=1.0)) * (2.0 if call else 1.0))
    assert not [w for w in said if "wrote its own state" in str(w.message)]
    assert net.calls == 3 and net.flag is True


class PutBack(nn.Module):
    """Swaps its layer's weight for the call and puts it back: through
    ``torch.func.functional_call`` (MAML's inner step), or by deleting it, setting a scaled
    one, and setting the same tensor again (on a replica whose weight is a copy, that tensor is
    not a Parameter: it comes back as a plain attribute)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "functional_call":
            scaled = {"weight": self.lin.weight * 0.5}
            return torch.func.functional_call(self.lin, scaled, (x,))  # type: ignore[no-any-return]
        weight = self.lin.weight
        del self.lin.weight
        self.lin.weight = weight * 0.5
        out = self.lin(x)
        del self.lin.weight
        self.lin.weight = weight
        return out


class Counts(nn.Module):
    """Writes plain attributes on every replica (a counter, the chunk it saw)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0
        self.last = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = f"chunk of {x.shape[0]}"
        return self.lin(x)


@pytest.mark.parametrize(
    ("make", "devices", "chunk_sizes"),
    [
        *((lambda: PutBack("functional_call"), d, None) for d in DEVICE_LISTS),
        *((lambda: PutBack("set again"), d, None) for d in DEVICE_LISTS),
        # replica 0 is a copy whose writes the wrapper copies back (issue 42)
        (Counts, ["cpu", "cpu:1", "cpu:1"], [0, 4, 3]),
        (Counts, ["cpu:1", "cpu:1"], None),
    ],
    ids=[
        *(f"functional_call-{i}" for i in ("shared", "copied", "three")),
        *(f"set again-{i}" for i in ("shared", "copied", "three")),
        "replica 0 skipped",
        "replica 0 a copy",
    ],
)
def test_writes_put_back_or_copied_back_are_not_said(
    make: Callable[[], nn.Module], devices: list[str], chunk_sizes: list[int] | None, watch: str
) -> None:
    """Not a write of the state the next calls read: a table written and put back in the same
    call, or a write of the replica whose writes land on the module. (Each was said on 6d4a14e,
    as "an attribute".)"""
    torch.manual_seed(0)
    net = make()
    oracle = copy.deepcopy(net)
    model = dp.DataParallel(net, devices, chunk_sizes=chunk_sizes)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.rand(7, 3)
            torch.testing.assert_close(model(x), oracle(x))
    assert not [str(w.message) for w in said if "wrote its own state" in str(w.message)]
    if isinstance(net, Counts):
        assert net.calls == 3 and net.last == "chunk of 4"
