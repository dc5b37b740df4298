"""The caller's thread state reaches every replica (issue 20, item 5).

Oracle pattern: the same module on one device, under the same transform, mode, hooks or
context, is the reference for outputs, gradients and what the mode or hook saw. Real pool
threads, three device lists, an uneven batch (7 rows over 2 or 3 replicas).
"""

from __future__ import annotations

import contextvars
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import dataparallel as dp
from dataparallel.parallel_apply import _thread_state as thread_state
from dataparallel.parallel_apply._pool import THREAD_PREFIX

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
ROWS = 7  # uneven on 2 and on 3 replicas

VAR: contextvars.ContextVar[float] = contextvars.ContextVar("dataparallel_test_var", default=1.0)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _x(*lead: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(*lead, ROWS, 4)


class Threads(nn.Module):
    """Records the thread each replica's forward ran on (a shared list, as in torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(threading.current_thread().name)
        return self.lin(x)


@pytest.fixture(params=DEVICE_LISTS, ids=lambda d: "+".join(d))
def devices(request: pytest.FixtureRequest) -> list[str]:
    return list(request.param)


# -- torch.func transforms: run inline, the one-device result -----------------------------------


def test_grad_of_the_input_equals_one_device(devices: list[str]) -> None:
    net, x = _net(), _x()
    w = dp.DataParallel(net, devices)
    got = torch.func.grad(lambda t: w(t).pow(2).sum())(x)
    want = torch.func.grad(lambda t: net(t).pow(2).sum())(x)
    assert got.abs().sum() > 0
    for rows in got.split(3):  # the rows on replicas 1+ were zero before
        assert rows.abs().sum() > 0
    torch.testing.assert_close(got, want)


def test_vmap_equals_one_device(devices: list[str]) -> None:
    net, x = _net(), _x(2)
    w = dp.DataParallel(net, devices)
    torch.testing.assert_close(torch.func.vmap(w)(x), torch.func.vmap(net)(x))


def test_jacrev_and_jacfwd_equal_one_device(devices: list[str]) -> None:
    net, x = _net(), _x()
    w = dp.DataParallel(net, devices)
    torch.testing.assert_close(torch.func.jacrev(w)(x), torch.func.jacrev(net)(x))
    torch.testing.assert_close(torch.func.jacfwd(w)(x), torch.func.jacfwd(net)(x))


def test_jvp_and_hessian_equal_one_device(devices: list[str]) -> None:
    net, x = _net(), _x()
    w = dp.DataParallel(net, devices)
    tangent = torch.ones_like(x)
    torch.testing.assert_close(
        torch.func.jvp(w, (x,), (tangent,)), torch.func.jvp(net, (x,), (tangent,))
    )
    torch.testing.assert_close(
        torch.func.hessian(lambda t: w(t).sum())(x), torch.func.hessian(lambda t: net(t).sum())(x)
    )


def test_vmap_of_grad_per_sample_equals_one_device(devices: list[str]) -> None:
    net, x = _net(), _x(3)
    w = dp.DataParallel(net, devices)

    def per_sample(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return torch.func.vmap(torch.func.grad(lambda t: model(t).pow(2).sum()))

    torch.testing.assert_close(per_sample(w)(x), per_sample(net)(x))


class Outer(nn.Module):
    """A model holding the wrapper as a child: torch.func.functional_call refuses an
    nn.DataParallel as its root (as it refuses torch's own), not as a submodule."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_functional_call_on_the_wrapper_itself_is_torchs_refusal(devices: list[str]) -> None:
    w = dp.DataParallel(_net(), devices)
    params = {k: v.detach() for k, v in w.named_parameters()}
    with pytest.raises(RuntimeError, match="DataParallel"):
        torch.func.functional_call(w, params, (_x(),))


def test_grad_of_parameters_through_functional_call_with_the_modules_own_values(
    devices: list[str],
) -> None:
    net, x = _net(), _x()
    outer = Outer(dp.DataParallel(net, devices))
    params = {k: v.detach() for k, v in outer.named_parameters()}
    own = {k: v.detach() for k, v in net.named_parameters()}
    got = torch.func.grad(lambda p: torch.func.functional_call(outer, p, (x,)).pow(2).sum())(params)
    want = torch.func.grad(lambda p: torch.func.functional_call(net, p, (x,)).pow(2).sum())(own)
    for name, value in want.items():
        torch.testing.assert_close(got[f"inner.module.{name}"], value)


def test_functional_call_with_other_parameters_equals_one_device(devices: list[str]) -> None:
    net, x = _net(), _x()
    outer = Outer(dp.DataParallel(net, devices))
    outer(x), outer(x)  # warm replicas: the swap must still be seen
    doubled = {k: v * 2 for k, v in net.named_parameters()}
    swapped = {f"inner.module.{k}": v for k, v in doubled.items()}
    got = torch.func.functional_call(outer, swapped, (x,))
    torch.testing.assert_close(got, torch.func.functional_call(net, doubled, (x,)))


def test_an_error_under_a_transform_names_it(devices: list[str]) -> None:
    class Item(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * t.sum().item()

    w = dp.DataParallel(Item(), devices)
    with pytest.raises(RuntimeError) as one_device:
        torch.func.vmap(Item())(_x(2))
    with pytest.raises(RuntimeError, match=r"torch\.func transform Vmap") as many:
        torch.func.vmap(w)(_x(2))
    assert "replica 0" in str(many.value)
    assert str(one_device.value).split("\n")[0][:40] in str(many.value)


# -- function and dispatch modes: run inline, they see the whole batch --------------------------


def test_flop_counter_counts_the_whole_batch(devices: list[str]) -> None:
    net, x = _net(), _x()
    w = dp.DataParallel(net, devices)
    with FlopCounterMode(display=False) as many:
        w(x)
    with FlopCounterMode(display=False) as one:
        net(x)
    assert many.get_total_flops() == one.get_total_flops() == 2 * ROWS * (4 * 8 + 8 * 3)


class LinearRows(TorchFunctionMode):
    """A function mode that adds up the rows every ``F.linear`` call sees."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.nn.functional.linear:
            self.rows += args[0].shape[0]
        return func(*args, **(kwargs or {}))


class AddmmRows(TorchDispatchMode):
    """A dispatch mode that adds up the rows every ``aten.addmm`` sees."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.addmm.default:
            self.rows += args[1].shape[0]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode_type", [LinearRows, AddmmRows])
def test_function_and_dispatch_modes_see_every_replica(
    devices: list[str], mode_type: type[LinearRows] | type[AddmmRows]
) -> None:
    net, x = _net(), _x()
    w = dp.DataParallel(net, devices)
    with torch.no_grad(), mode_type() as mode:
        got = w(x)
    torch.testing.assert_close(got, net(x))
    assert mode.rows == 2 * ROWS  # two linear layers, every row once


def test_modes_run_inline_and_the_next_plain_call_uses_the_pool(devices: list[str]) -> None:
    module = Threads()
    w = dp.DataParallel(module, devices)
    here = threading.current_thread().name
    with FlopCounterMode(display=False):
        w(_x())
    assert module.seen == [here] * len(devices)
    module.seen.clear()
    w(_x())
    assert module.seen.count(here) == 1
    assert sum(name.startswith(THREAD_PREFIX) for name in module.seen) == len(devices) - 1


# -- saved-tensor hooks: run inline, every replica's tensors, gradients equal -------------------


def test_saved_tensors_hooks_see_every_replica(devices: list[str]) -> None:
    net, x = _net(), _x()
    w = dp.DataParallel(net, devices)
    rows: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2 and t.shape[1] == 4:  # the first Linear's input
            rows.append(t.shape[0])
        return t

    x1 = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        w(x1).pow(2).sum().backward()
    assert sum(rows) == ROWS
    assert len(rows) == len(devices)
    x2 = x.clone().requires_grad_()
    net(x2).pow(2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    assert x.grad is not None
    return [x.grad, *grads]  # type: ignore[list-item]


def test_save_on_cpu_and_checkpoint_give_one_device_gradients(devices: list[str]) -> None:
    net, x = _net(), _x()
    w = dp.DataParallel(net, devices)
    x0 = x.clone().requires_grad_()
    net(x0).pow(2).sum().backward()
    want = _grads(net, x0)
    x1 = x.clone().requires_grad_()
    with torch.autograd.graph.save_on_cpu():
        loss = w(x1).pow(2).sum()
    loss.backward()
    torch.testing.assert_close(_grads(net, x1), want)
    x2 = x.clone().requires_grad_()
    checkpoint(w, x2, use_reentrant=False).pow(2).sum().backward()
    torch.testing.assert_close(_grads(net, x2), want)


# -- replayed in the worker: inference mode, default device, contextvars ------------------------


class InPlace(nn.Module):
    """Writes its input in place, as some inference code does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + 1


def test_inference_mode_in_place_on_inputs_as_on_one_device(devices: list[str]) -> None:
    w = dp.DataParallel(InPlace(), devices)
    with torch.inference_mode():
        x = _x()
        got = w(x.clone())
        want = InPlace()(x.clone())
    torch.testing.assert_close(got, want)
    assert got.is_inference()


def test_inference_mode_runs_on_the_pool(devices: list[str]) -> None:
    module = Threads()
    w = dp.DataParallel(module, devices)
    with torch.inference_mode():
        w(_x())
    assert sum(name.startswith(THREAD_PREFIX) for name in module.seen) == len(devices) - 1


class MadeHere(nn.Module):
    """Adds a tensor made in forward: it lands on the default device."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[str] = []
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        made = torch.ones(x.shape[1])
        self.devices.append(str(made.device))
        self.seen.append(threading.current_thread().name)
        return x + made


def test_default_device_is_replayed_on_the_pool(devices: list[str]) -> None:
    module = MadeHere()
    w = dp.DataParallel(module, devices)
    with torch.device("meta"):  # a device no replica runs on: each worker must see it
        assert not thread_state.must_run_inline()
        replay = thread_state.replay()
        assert len(replay) == 1
    with torch.device("cpu"):
        torch.testing.assert_close(w(_x()), _x() + 1)
    assert sum(name.startswith(THREAD_PREFIX) for name in module.seen) == len(devices) - 1
    assert module.devices == ["cpu"] * len(devices)


class ReadsVar(nn.Module):
    """Scales by a context variable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * VAR.get()


class SetsVar(nn.Module):
    """Sets a context variable: replica 0's set lands in the caller's context (it runs on the
    caller's thread), the others' in their own copies, as their attribute writes do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        VAR.set(VAR.get() + x.shape[0])
        return x


def test_contextvars_reach_every_replica(devices: list[str]) -> None:
    w = dp.DataParallel(ReadsVar(), devices)
    x = _x()

    def run() -> torch.Tensor:
        VAR.set(3.0)
        return w(x)

    got = contextvars.copy_context().run(run)
    torch.testing.assert_close(got, x * 3)
    assert VAR.get() == 1.0  # the test's own context untouched
    torch.testing.assert_close(w(x), x)  # nothing left behind in the workers


def test_a_replicas_contextvar_set_is_its_own(devices: list[str]) -> None:
    w = dp.DataParallel(SetsVar(), devices)

    def run() -> float:
        w(_x())
        return VAR.get()

    first_chunk = -(-ROWS // len(devices))
    assert contextvars.copy_context().run(run) == 1.0 + first_chunk
    assert VAR.get() == 1.0


def test_contextvars_from_two_caller_threads_stay_apart(devices: list[str]) -> None:
    results: dict[float, list[bool]] = {2.0: [], 5.0: []}
    x = _x()

    def caller(value: float) -> None:
        w = dp.DataParallel(ReadsVar(), devices)
        VAR.set(value)
        for _ in range(30):
            results[value].append(bool(torch.equal(w(x), x * value)))

    threads = [threading.Thread(target=caller, args=(v,)) for v in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {2.0: [True] * 30, 5.0: [True] * 30}


def test_a_mode_on_one_thread_does_not_reach_another(devices: list[str]) -> None:
    counted: list[int] = []
    plain_threads: list[str] = []
    barrier = threading.Barrier(2)

    def counting() -> None:
        net = _net()
        w = dp.DataParallel(net, devices)
        barrier.wait()
        for _ in range(10):
            with FlopCounterMode(display=False) as mode:
                w(_x())
            counted.append(mode.get_total_flops())

    def plain() -> None:
        module = Threads()
        w = dp.DataParallel(module, devices)
        barrier.wait()
        for _ in range(10):
            w(_x())
        plain_threads.extend(module.seen)

    threads = [threading.Thread(target=counting), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counted == [2 * ROWS * (4 * 8 + 8 * 3)] * 10
    assert sum(n.startswith(THREAD_PREFIX) for n in plain_threads) == 10 * (len(devices) - 1)


# -- the common path: nothing captured, and cheap -----------------------------------------------


def test_nothing_is_captured_when_no_state_is_active() -> None:
    assert not thread_state.must_run_inline()
    assert thread_state.replay() == ()
    assert thread_state.active_state() == ""


def test_the_check_is_its_own_two_functions_and_a_few_getters() -> None:
    """The common path's cost, counted rather than timed (0.23 us a call, measured quiet; a
    timed limit of 2 us failed on a loaded machine): the check runs its two functions and a
    handful of C-level getters of torch's and Python's state, nothing else."""

    def check() -> None:
        if not thread_state.must_run_inline():
            thread_state.replay()
            len(thread_state.copy_context())

    calls: list[str] = []

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)
        elif event == "c_call":
            calls.append("<C>")

    check()
    sys.setprofile(profile)
    try:
        check()
    finally:
        sys.setprofile(None)
    assert [c for c in calls if c != "<C>"] == ["check", "must_run_inline", "replay"], calls
    assert calls.count("<C>") <= 12, calls  # 9 measured, setprofile's own call included
