"""The replica check: every way a module changes between calls is seen, locally.

A cached replica set is refreshed cheaply (tensors only) while its snapshot of the module tree
holds, so each test below first makes the cache reach that fast path, then changes the module
one way (through torch's methods or past them) and checks that the next ``replicate`` mirrors
it. Oracle: every replica's output equals the module's own on the same input, and every
replica's training flags are the module's. Nothing in torch is patched to see any of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from dataparallel.replicate import replicate
from dataparallel.replicate._check import Snapshot
from dataparallel.replicate._replicas import Replicas

# "cpu:1" makes replica 1 a copy on another device (parameters copied), so both the shared
# and the copied paths are checked.
DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"]]


class Flex(nn.Module):
    """A module with a place for every kind of change the tests make."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.seq = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        self.mlist = nn.ModuleList([nn.Linear(3, 3)])
        self.mdict = nn.ModuleDict({"a": nn.Linear(3, 3)})
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.seq(self.bn(self.fc1(x)))
        for layer in self.mlist:
            h = layer(h)
        for layer in self.mdict.values():
            h = layer(h)
        h = h * getattr(self, "scale", 1.0)
        for name in ("offset", "gain"):  # a buffer and a parameter some tests register
            extra = getattr(self, name, None)
            if extra is not None:
                h = h + extra if name == "offset" else h * extra
        if "extra" in self._modules:
            h = self.extra(h)
        return h


class Double(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2


def _flex() -> Flex:
    torch.manual_seed(0)
    model = Flex().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
    # Modules the changes add, made now (kept past __setattr__, out of the module tree).
    model.__dict__["_spares"] = {"3": nn.Linear(3, 3).eval(), "4": nn.Linear(4, 3).eval()}
    return model


def _spare(model: Flex, key: str = "3") -> nn.Module:
    return model.__dict__["_spares"][key]


def _hook(model: Flex) -> Any:
    return model.fc1.register_forward_hook(lambda m, i, o: o * 2)


def _remove_hook(model: Flex) -> None:
    model.__dict__["_test_handle"].remove()


def _rename_last_child(model: Flex) -> None:
    # The last child, renamed in place: same values, same count, another name. Its forward
    # finds it under the new name only.
    model._modules["extra2"] = model._modules.pop("extra")


def _setup_remove_hook(model: Flex) -> None:
    model.__dict__["_test_handle"] = model.seq[0].register_forward_pre_hook(
        lambda m, args: (args[0] + 1,)
    )


def _setup_two_hooks(model: Flex) -> None:
    # Two hooks whose order matters: (o + 1) * 3 or o * 3 + 1.
    model.__dict__["_test_handle"] = model.seq[0].register_forward_hook(lambda m, i, o: o + 1)
    model.seq[0].register_forward_hook(lambda m, i, o: o * 3)


def _reorder_hooks(model: Flex) -> None:
    # In place: same hooks, same count, another order (an OrderedDict's order lives outside
    # its dictionary's storage).
    model.seq[0]._forward_hooks.move_to_end(model.__dict__["_test_handle"].id)


CHANGES: dict[str, Callable[[Flex], Any]] = {
    "plain attribute": lambda m: setattr(m, "scale", 3.0),
    "attribute deleted": lambda m: delattr(m, "scale"),
    "submodule to train": lambda m: m.seq.train(),
    "whole module to train": lambda m: m.train(),
    "forward hook added": _hook,
    "forward pre-hook added": lambda m: m.mlist[0].register_forward_pre_hook(
        lambda mod, args: (args[0] * -1,)
    ),
    "hook removed": _remove_hook,
    "to float64": lambda m: m.double(),
    "submodule replaced": lambda m: setattr(m, "fc1", _spare(m, "4")),
    "parameter replaced": lambda m: setattr(m.fc1, "bias", nn.Parameter(torch.ones(3))),
    "buffer reassigned": lambda m: setattr(m.bn, "running_mean", torch.full((3,), 2.0)),
    "register_buffer": lambda m: m.register_buffer("offset", torch.ones(3)),
    "register_parameter": lambda m: m.register_parameter("gain", nn.Parameter(torch.ones(3) * 3)),
    "add_module": lambda m: m.add_module("extra", _spare(m)),
    "Sequential.insert": lambda m: m.seq.insert(0, _spare(m)),
    "Sequential.append": lambda m: m.seq.append(_spare(m)),
    "ModuleList.insert": lambda m: m.mlist.insert(0, _spare(m)),
    "ModuleList.append": lambda m: m.mlist.append(_spare(m)),
    "ModuleDict del": lambda m: m.mdict.__delitem__("a"),
    "ModuleDict clear": lambda m: m.mdict.clear(),
    "ModuleDict pop": lambda m: m.mdict.pop("a"),
    "ModuleDict set": lambda m: m.mdict.__setitem__("b", _spare(m)),
    "parametrization": lambda m: parametrize.register_parametrization(m.fc1, "weight", Double()),
    "in-place parameter": lambda m: m.fc1.weight.data.mul_(3),
    "parameter .data": lambda m: setattr(m.fc1.weight, "data", m.fc1.weight.data + 1),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: v + 1 if v.is_floating_point() else v for k, v in m.state_dict().items()}
    ),
    "load_state_dict assign": lambda m: m.load_state_dict(
        {k: v.clone() + 1 if v.is_floating_point() else v for k, v in m.state_dict().items()},
        assign=True,
    ),
    # Past torch's methods: what loaders, functional_call and hand-written code do.
    "__dict__ write": lambda m: m.__dict__.__setitem__("scale", 6.0),
    "_parameters write": lambda m: m.fc1._parameters.__setitem__(
        "weight", nn.Parameter(torch.randn(3, 4))
    ),
    "_buffers write": lambda m: m.bn._buffers.__setitem__("running_var", torch.full((3,), 4.0)),
    "_modules write": lambda m: m._modules.__setitem__("fc1", _spare(m, "4")),
    "_modules key renamed": _rename_last_child,
    "hook table write": lambda m: m.seq[0]._forward_hooks.__setitem__(
        10**9, lambda mod, i, o: o - 1
    ),
    "hooks reordered in place": _reorder_hooks,
    # No table written: the module's class, or its dictionary object, replaced.
    "class assigned": lambda m: setattr(m.seq[1], "__class__", nn.Sigmoid),
    "__dict__ assigned": lambda m: setattr(m, "__dict__", {**m.__dict__, "scale": 5.0}),
    "training flag in __dict__": lambda m: (
        m.seq[1].__dict__.__setitem__("training", True)
        or m.bn.__dict__.__setitem__("training", True)
    ),
}
SETUP: dict[str, Callable[[Flex], Any]] = {
    "hook removed": _setup_remove_hook,
    "_modules key renamed": lambda m: m.add_module("extra", _spare(m)),
    "hooks reordered in place": _setup_two_hooks,
}


def _check(model: nn.Module, devices: list[str]) -> None:
    dtype = next(model.parameters()).dtype
    x = torch.randn(5, 4, dtype=dtype)
    with torch.no_grad():
        replicas = replicate(model, devices)
        expected = model(x)
        for replica in replicas:
            torch.testing.assert_close(replica(x), expected)
            flags = [m.training for m in replica.modules()]
            assert flags == [m.training for m in model.modules()]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=["shared", "copied"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_the_fast_path_is_seen(change: str, devices: list[str]) -> None:
    model = _flex()
    SETUP.get(change, lambda m: None)(model)
    _check(model, devices)  # builds the replicas
    _check(model, devices)  # the fast path: nothing changed since
    with torch.no_grad():
        CHANGES[change](model)
    _check(model, devices)
    _check(model, devices)  # and the call after it, on the fast path again


def test_an_unchanged_module_keeps_its_replica_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _flex()
    x = torch.randn(6, 4)
    with torch.no_grad():
        first = replicate(model, ["cpu", "cpu:1"])
        fills = _fills(monkeypatch)
        for _ in range(3):
            replicas = replicate(model, ["cpu", "cpu:1"])
            for replica in replicas:
                replica(x)
        assert all(a is b for a, b in zip(first, replicas, strict=True))
        # nothing was written, so no replica dictionary was refilled
        assert fills == []


def _fills(monkeypatch: pytest.MonkeyPatch) -> list[list[int] | None]:
    """What each refill of the replicas' dictionaries was for (``None``: every module), as it
    happens (the dictionaries themselves are refilled in place)."""
    seen: list[list[int] | None] = []
    fill = Replicas._fill

    def spy(self: Replicas, root: nn.Module, buffers: Any, only: Any, search: Any = None) -> None:
        seen.append(None if only is None else list(only))
        fill(self, root, buffers, only, search)

    monkeypatch.setattr(Replicas, "_fill", spy)
    return seen


def test_only_the_written_module_is_refilled(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _flex()
    with torch.no_grad():
        _, r1 = replicate(model, ["cpu", "cpu"])
        fills = _fills(monkeypatch)
        model.seq[1].extra_flag = True
        _, again = replicate(model, ["cpu", "cpu"])
    names = [name for name, _ in model.named_modules()]
    assert again is r1 and [[names[i] for i in only or ()] for only in fills] == [["seq.1"]]
    assert again.seq[1].extra_flag is True


def test_nothing_in_torch_is_patched() -> None:
    names = ("__setattr__", "__delattr__", "register_parameter", "register_buffer", "_apply")
    before = {name: nn.Module.__dict__[name] for name in names}
    model = _flex()
    _check(model, ["cpu", "cpu:1"])
    _check(model, ["cpu", "cpu:1"])
    assert {name: nn.Module.__dict__[name] for name in names} == before


def test_writes_to_other_modules_do_not_touch_the_check() -> None:
    # A module outside the tree, written on every step, leaves the snapshot holding.
    model = _flex()
    metric = nn.Module()
    metric.total = 0
    _check(model, ["cpu", "cpu"])
    snapshot = Snapshot(list(model.modules()))
    for _ in range(5):
        metric.total += 1
        assert snapshot.same()
    model.scale = 1.5
    assert not snapshot.same()
    assert snapshot.changed() == [0]


class Counter(nn.Module):
    """Writes an attribute in its forward, as some modules keep a step count."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.lin(x)


def test_what_a_forward_writes_on_a_replica_does_not_outlive_the_call() -> None:
    model = Counter()
    x = torch.randn(2, 3)
    for _ in range(3):
        r0, r1 = replicate(model, ["cpu", "cpu"])
        assert r0 is model and r1.calls == model.calls  # replica 1 mirrors the module again
        r0(x)
        r1(x)
    assert model.calls == 3  # replica 0 is the module: its writes land, once per call


class OwnSetattr(Flex):
    """A module whose ``__setattr__`` does not go through ``nn.Module``'s for plain values."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, (int, float)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def test_a_module_with_its_own_setattr_is_seen() -> None:
    torch.manual_seed(0)
    model = OwnSetattr().eval()
    _check(model, ["cpu", "cpu"])
    _check(model, ["cpu", "cpu"])
    model.scale = 4.0  # past nn.Module.__setattr__
    _check(model, ["cpu", "cpu"])


def test_training_copies_follow_grad_mode_switches_on_the_fast_path() -> None:
    # With grad enabled, replicas on another device get new differentiable copies each call;
    # without, copies made without grad are refreshed in place: switching back and forth
    # must leave each replica holding the tensors of this call.
    model = _flex()
    x = torch.randn(4, 4)
    for grad in (True, False, True, False):
        with torch.set_grad_enabled(grad):
            _, r1 = replicate(model, ["cpu", "cpu:1"])
            assert (r1.fc1.weight.grad_fn is not None) == grad
            out = r1(x)
            torch.testing.assert_close(out, model(x))
            if grad:
                out.sum().backward()
                assert model.fc1.weight.grad is not None
                model.zero_grad()


class Recorder(nn.Module):
    """Appends the replica object running it to a list the replicas share (as in torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(id(self))
        return self.lin(x)


def test_data_parallel_reuses_its_replicas_across_calls() -> None:
    import dataparallel as dp

    model = Recorder()
    x = torch.randn(4, 3)
    dp.data_parallel(model, x, ["cpu", "cpu"])
    first = sorted(model.seen)
    model.seen.clear()
    dp.data_parallel(model, x, ["cpu", "cpu"])
    assert sorted(model.seen) == first and len(set(first)) == 2


def test_a_buffer_copy_is_written_in_place_only_while_no_graph_holds_it() -> None:
    model = _flex()  # eval(): BatchNorm saves its running statistics for backward
    x = torch.randn(6, 4, requires_grad=True)
    _, r1 = replicate(model, ["cpu", "cpu"])
    first = r1.bn.running_mean
    out = r1(x)  # this graph saved replica 1's copy
    _, r1 = replicate(model, ["cpu", "cpu"])
    assert r1.bn.running_mean is not first  # held by the graph: replaced
    out.sum().backward()  # no error: the saved copy was never written
    del out
    second = r1.bn.running_mean
    r1(x).sum().backward()  # this graph is freed by its backward
    _, r1 = replicate(model, ["cpu", "cpu"])
    assert r1.bn.running_mean is second  # free again: written in place
    torch.testing.assert_close(r1.bn.running_mean, model.bn.running_mean)
