"""The replicas' tensors against one device: buffers and parameters written past torch's
methods, ``swap_tensors``, and copy-on-write under aliases (issue 29, items 4 to 6).

Each case warms a ``dp.DataParallel`` (the replica set reaches its fast path), changes the
module one way, applies the same change to an identical copy run alone on one device (the
oracle), and compares outputs and gradients. Nothing we attach to the user's tensors may
change what torch lets the user do with them (``swap_tensors`` refuses a tensor with a weak
reference).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
IDS = ["shared", "copied", "mixed"]


class Net(nn.Module):
    """Linear, BatchNorm (in eval: its running statistics shape the output) and a buffer used
    through an alias (``.detach()``), which shares the buffer's version counter but not its
    use count."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.lin(x))) * self.scale.detach()


def _pair(train: bool = False) -> tuple[nn.Module, nn.Module]:
    """The module and the oracle, an identical copy run on one device."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    model.train(train)
    return model, copy.deepcopy(model)


def _warm(wrapper: nn.Module, x: torch.Tensor) -> None:
    """Two calls: the second takes the replica set's fast path."""
    with torch.no_grad():
        wrapper(x)
        wrapper(x)


def _assert_grads(model: nn.Module, oracle: nn.Module) -> None:
    mine = {n: p.grad for n, p in model.named_parameters()}
    theirs = {n: p.grad for n, p in oracle.named_parameters()}
    assert mine.keys() == theirs.keys()
    for name, grad in theirs.items():
        got = mine[name]
        assert (got is None) == (grad is None), name
        if grad is not None and got is not None:
            assert_close_rel(got, grad, msg=name)


def _check(wrapper: nn.Module, model: nn.Module, oracle: nn.Module, x: torch.Tensor) -> None:
    """Outputs without grad, then outputs and gradients with grad, equal the oracle's."""
    with torch.no_grad():
        assert_close_rel(wrapper(x), oracle(x), msg="no_grad output")
    out, ref = wrapper(x), oracle(x)
    assert_close_rel(out, ref, msg="output")
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    _assert_grads(model, oracle)


# -- item 4: tensors replaced past torch's methods -------------------------------------------


def _swap(t: torch.Tensor, value: torch.Tensor) -> None:
    torch.utils.swap_tensors(t, value)


CHANGES: dict[str, Callable[[Net], Any]] = {
    "buffer .data =": lambda m: setattr(m.bn.running_mean, "data", torch.full((6,), 3.0)),
    "buffer set_": lambda m: m.bn.running_mean.set_(torch.full((6,), 3.0)),
    "buffer swap_tensors": lambda m: _swap(m.bn.running_var, torch.full((6,), 4.0)),
    "buffer of another dtype by .data": lambda m: setattr(
        m.scale, "data", torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    ),
    "buffer replaced by _buffers": lambda m: m._buffers.__setitem__("scale", torch.ones(3) * 2),
    "buffer requires_grad_": lambda m: m.scale.requires_grad_(),
    "parameter .data =": lambda m: setattr(m.lin.weight, "data", torch.full((6, 4), 0.3)),
    "parameter set_": lambda m: m.out.bias.set_(torch.full((3,), -2.0)),
    "parameter swap_tensors": lambda m: _swap(m.out.weight, nn.Parameter(torch.ones(3, 6) / 4)),
    "parameter requires_grad_(False)": lambda m: m.lin.weight.requires_grad_(False),
    "parameter of another dtype by .data": lambda m: setattr(
        m.out.bias, "data", torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    ),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: v * 1.5 if v.is_floating_point() else v for k, v in m.state_dict().items()}
    ),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        {k: v * 0.5 if v.is_floating_point() else v.clone() for k, v in m.state_dict().items()},
        assign=True,
    ),
    "non-persistent buffer registered": lambda m: m.register_buffer(
        "scale", torch.tensor([3.0, 2.0, 1.0]), persistent=False
    ),
}


def _same_change(change: Callable[[Net], Any], model: Net, oracle: Net) -> None:
    with torch.no_grad():
        change(model)
        change(oracle)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
@pytest.mark.parametrize("name", list(CHANGES))
def test_a_tensor_replaced_past_torch_is_seen(name: str, devices: list[str]) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    _warm(wrapper, x)
    _same_change(CHANGES[name], model, oracle)  # type: ignore[arg-type]
    if name.endswith("another dtype by .data"):  # the oracle needs one dtype to run
        model.double()
        oracle.double()
        x = x.double()
    _check(wrapper, model, oracle, x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_buffer_written_between_calls_with_grad(devices: list[str]) -> None:
    # the fast path's fused buffer copy must read the buffer as it is now, however replaced
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    for step in range(3):
        for m in (model, oracle):
            m.bn.running_mean.data = torch.full((6,), float(step))
        out, ref = wrapper(x), oracle(x)
        assert_close_rel(out, ref, msg=f"step {step}")


# -- item 5: swap_tensors on a module with a warm wrapper ------------------------------------


@pytest.fixture
def swap_on_conversion() -> Iterator[None]:
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


SWAPS: dict[str, Callable[[Net], Any]] = {
    "to float64": lambda m: m.to(torch.float64),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: v * 2 if v.is_floating_point() else v for k, v in m.state_dict().items()}
    ),
    "swap_tensors(weight)": lambda m: torch.utils.swap_tensors(
        m.lin.weight, nn.Parameter(torch.full((6, 4), 0.5))
    ),
    "half then float": lambda m: m.half().float(),
}


@pytest.mark.usefixtures("swap_on_conversion")
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
@pytest.mark.parametrize("name", list(SWAPS))
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_swap_tensors_works_on_a_wrapped_module(name: str, devices: list[str], grad: bool) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    with torch.set_grad_enabled(grad):
        wrapper(x)
        out = wrapper(x)
    if grad:  # a live graph holds the parameters; torch allows a swap once it is freed
        out.sum().backward()
        oracle(x).sum().backward()
        del out
    SWAPS[name](model)
    SWAPS[name](oracle)
    if name == "to float64":
        x = x.double()
    _check(wrapper, model, oracle, x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_nothing_is_attached_to_the_module_tensors(devices: list[str]) -> None:
    # what swap_tensors checks: no weak reference, and no other owner of the tensor
    model, _ = _pair()
    wrapper = dp.DataParallel(model, devices)
    _warm(wrapper, torch.randn(7, 4))
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert not weakref.getweakrefs(t), name
        assert t._use_count() == 1, name


# -- item 6: copy-on-write under aliases -------------------------------------------------------


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_two_calls_then_one_backward_through_a_detached_buffer(devices: list[str]) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    a, b = torch.randn(7, 4), torch.randn(5, 4)
    (wrapper(a).sum() * wrapper(b).sum()).backward()
    (oracle(a).sum() * oracle(b).sum()).backward()
    _assert_grads(model, oracle)


class Views(nn.Module):
    """Buffers reached through views and aliases the graph saves: a slice, a reshape, an
    expand, ``.data`` (graph-wise a detach)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.register_buffer("table", torch.linspace(-1.0, 1.0, 12))
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h * self.table[:6] + h * self.table.view(2, 6)[1]
        return h * self.gain.data.expand(x.shape[0], 6)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_three_calls_then_one_backward_through_buffer_views(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Views()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    xs = [torch.randn(n, 4) for n in (7, 5, 6)]
    sum(wrapper(x).pow(2).sum() for x in xs).backward()  # type: ignore[union-attr]
    sum(oracle(x).pow(2).sum() for x in xs).backward()  # type: ignore[union-attr]
    _assert_grads(model, oracle)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_call_without_a_chunk_on_device_0_keeps_earlier_graphs(devices: list[str]) -> None:
    # weights=[1, 3] and a batch of one: device 0 gets no chunk, replica 0 runs elsewhere and
    # its buffers are written back to the module, which an earlier call's graph saved.
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices, weights=[1, 3, 1][: len(devices)])
    a, b = torch.randn(4, 4), torch.randn(1, 4)
    (wrapper(a).sum() * wrapper(b).sum()).backward()
    (oracle(a).sum() * oracle(b).sum()).backward()
    _assert_grads(model, oracle)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_call_without_a_chunk_on_device_0_updates_running_statistics(
    devices: list[str],
) -> None:
    # the write-back the test above restricts still lands what replica 0's forward wrote
    model, oracle = _pair(train=True)
    sizes = [0, 5] + [0] * (len(devices) - 2)
    wrapper = dp.DataParallel(model, devices, chunk_sizes=sizes)
    x = torch.randn(5, 4)
    for _ in range(2):
        out, ref = wrapper(x), oracle(x)
        assert_close_rel(out, ref, msg="output")
    for name, buf in oracle.named_buffers():
        assert_close_rel(dict(model.named_buffers())[name], buf, msg=name)


# -- beyond the list: tensors held in plain attributes and containers, functional_call ------


class Held(nn.Module):
    """Tensors a module holds outside its tables: a plain attribute, a list, a dict. Replicas
    share them by reference, as torch's do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.table = torch.linspace(0.5, 1.5, 3)
        self.pieces = [torch.ones(3), torch.full((3,), 0.5)]
        self.named = {"shift": torch.zeros(3)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.table
        for piece in self.pieces:
            h = h * piece
        return h + self.named["shift"]


HELD: dict[str, Callable[[Held], Any]] = {
    "attribute reassigned": lambda m: setattr(m, "table", torch.full((3,), 2.0)),
    "attribute written in place": lambda m: m.table.mul_(3.0),
    "attribute .data =": lambda m: setattr(m.table, "data", torch.full((3,), -1.0)),
    "attribute swap_tensors": lambda m: _swap(m.table, torch.full((3,), 4.0)),
    "list item replaced": lambda m: m.pieces.__setitem__(1, torch.full((3,), 3.0)),
    "list appended": lambda m: m.pieces.append(torch.full((3,), -2.0)),
    "list item written in place": lambda m: m.pieces[0].add_(1.0),
    "dict item replaced": lambda m: m.named.__setitem__("shift", torch.ones(3)),
    "dict item set_": lambda m: m.named["shift"].set_(torch.full((3,), 5.0)),
}


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
@pytest.mark.parametrize("name", list(HELD))
def test_a_tensor_held_outside_the_tables_is_seen(name: str, devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Held()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    _warm(wrapper, x)
    with torch.no_grad():
        HELD[name](model)
        HELD[name](oracle)
    _check(wrapper, model, oracle, x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_requires_grad_toggled_between_calls(devices: list[str]) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    for frozen in (True, False, True):
        for m in (model, oracle):
            m.zero_grad(set_to_none=True)
            m.lin.requires_grad_(not frozen)
            m.scale.requires_grad_(frozen)  # a buffer that asks for a gradient
        out, ref = wrapper(x), oracle(x)
        assert_close_rel(out, ref, msg=f"frozen={frozen}")
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        _assert_grads(model, oracle)


class Outer(nn.Module):
    """torch.func.functional_call refuses an nn.DataParallel as its root: hold it as a child."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_functional_call_with_buffers_then_the_module_again(devices: list[str]) -> None:
    model, oracle = _pair()
    outer = Outer(dp.DataParallel(model, devices))
    x = torch.randn(7, 4)
    _warm(outer, x)
    swapped = {
        "bn.running_mean": torch.full((6,), 0.25),
        "bn.running_var": torch.full((6,), 2.0),
        "scale": torch.tensor([1.0, -1.0, 2.0]),
        "out.bias": torch.zeros(3, requires_grad=True),
    }
    mine = {
        f"inner.module.{k}": v.detach().clone().requires_grad_(v.requires_grad)
        for k, v in swapped.items()
    }
    out = torch.func.functional_call(outer, mine, (x,))
    ref = torch.func.functional_call(oracle, swapped, (x,))
    assert_close_rel(out, ref, msg="functional_call")
    out.sum().backward()
    ref.sum().backward()
    grad = mine["inner.module.out.bias"].grad
    assert grad is not None and swapped["out.bias"].grad is not None
    assert_close_rel(grad, swapped["out.bias"].grad, msg="out.bias")
    _check(outer, model, oracle, x)  # and the module's own tensors afterwards


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_buffer_reassigned_with_another_dtype(devices: list[str]) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    _warm(wrapper, x)
    for m in (model, oracle):
        m.scale = m.scale.double()
    _check(wrapper, model, oracle, x)


class Padded(nn.Module):
    """A buffer whose shape shapes the output (concatenated beside the features)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("pad", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.lin(x), self.pad.expand(x.shape[0], -1)], 1)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
@pytest.mark.parametrize("size", [1, 2, 5])
def test_a_buffer_resized_in_place_is_seen(size: int, devices: list[str]) -> None:
    # resize_ to fewer elements keeps the storage (and its address); a shape that broadcasts
    # onto the old one must not be copied into it
    torch.manual_seed(0)
    model = Padded()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    _warm(wrapper, x)
    with torch.no_grad():
        for m in (model, oracle):
            m.pad.resize_(size).fill_(5.0)
    _check(wrapper, model, oracle, x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_call_without_grad_between_a_call_and_its_backward(devices: list[str]) -> None:
    # the no-grad call takes the fused in-place copy only if no graph saved an alias
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    a = torch.randn(7, 4)
    out = wrapper(a)
    for mode in (torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            assert_close_rel(wrapper(a * 2), oracle(a * 2), msg=mode.__name__)
    out.pow(2).sum().backward()
    oracle(a).pow(2).sum().backward()
    _assert_grads(model, oracle)


class SparseHolder(nn.Module):
    """A sparse buffer: no storage, no data pointer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("mask", torch.eye(3).to_sparse())
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.mask, self.lin(x).t()).t() * self.gain


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_sparse_buffer_leaves_the_other_tensors_checked(devices: list[str]) -> None:
    # a tensor without a data pointer must not switch off the check of the others
    torch.manual_seed(0)
    model = SparseHolder()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    _warm(wrapper, x)
    with torch.no_grad():
        for m in (model, oracle):
            m.gain.data = m.gain.double() * 2  # seen through its data pointer only
    _check(wrapper, model, oracle, x)


@pytest.mark.parametrize("devices", [["cpu:1", "cpu"], ["cpu:1", "cpu:1"]], ids=["1-0", "1-1"])
def test_replica_0_off_the_module_writes_back_only_what_changed(devices: list[str]) -> None:
    # "cpu:1" first: replica 0 is a copy on every call, and its buffers are written back to
    # the module after every call; an earlier call's graph saved the module's buffers
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    a, b = torch.randn(7, 4), torch.randn(5, 4)
    (wrapper(a).sum() * wrapper(b).sum()).backward()
    (oracle(a).sum() * oracle(b).sum()).backward()
    _assert_grads(model, oracle)
    for name, buf in oracle.named_buffers():
        assert_close_rel(dict(model.named_buffers())[name], buf, msg=name)
