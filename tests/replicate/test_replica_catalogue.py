"""The replica catalogue: what real training code does to a wrapper, against one device.

Each case runs the same module through ``dp.DataParallel`` on three device lists (replicas
sharing the module's parameters, replicas holding copies, and both at once) with uneven
batches, and compares outputs and gradients with the module run alone on one device (the
oracle). The cases are the ones caches get wrong: two calls before one backward, waves,
training and evaluation threads on one wrapper, compiled submodules, hooks registered in
forward, and modules dropped by the user.
"""

from __future__ import annotations

import copy
import gc
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
IDS = ["shared", "copied", "mixed"]


class ModeGain(nn.Module):
    """Doubles its input in training mode: a training flag that changes the result, and that
    (unlike BatchNorm's batch statistics) does not depend on how the batch is split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 if self.training else x


class Scaled(nn.Module):
    """Linear, BatchNorm and a buffer used as a factor: buffers autograd saves."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.mode = ModeGain()
        self.out = nn.Linear(6, 3)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 6))
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mode(self.bn(self.fc(x))) * self.gain * self.scale)


def _pair(seed: int = 0, train: bool = False) -> tuple[nn.Module, nn.Module]:
    """The module, and the oracle: an identical copy run on one device."""
    torch.manual_seed(seed)
    model = Scaled()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    model.train(train)
    return model, copy.deepcopy(model)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_grads(model: nn.Module, oracle: nn.Module) -> None:
    mine, theirs = _grads(model), _grads(oracle)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert_close_rel(mine[name], theirs[name], msg=name)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_two_calls_then_one_backward(devices: list[str]) -> None:
    # A siamese or contrastive loss: BatchNorm in eval() (fine-tuning) saves its running
    # statistics, the gain buffer is saved as a factor; neither may be written by call two.
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    a, b = torch.randn(7, 4), torch.randn(5, 4)
    ((wrapper(a).sum() - wrapper(b).sum()) ** 2).backward()
    ((oracle(a).sum() - oracle(b).sum()) ** 2).backward()
    _assert_grads(model, oracle)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_three_calls_with_a_change_between_then_one_backward(devices: list[str]) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    xs = [torch.randn(n, 4) for n in (7, 5, 3)]
    outs, refs = [], []
    for scale, x in zip((1.0, 2.0, 0.5), xs, strict=True):
        model.scale = oracle.scale = scale
        outs.append(wrapper(x))
        refs.append(oracle(x))
    sum((o**2).sum() for o in outs).backward()  # type: ignore[union-attr]
    sum((r**2).sum() for r in refs).backward()  # type: ignore[union-attr]
    _assert_grads(model, oracle)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_waves_then_one_backward(devices: list[str]) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices, max_size=2)
    x = torch.randn(11, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = wrapper(x)
    assert wrapper.last_call is not None and wrapper.last_call.waves > 1
    out.pow(2).sum().backward()
    oracle(x_ref).pow(2).sum().backward()
    _assert_grads(model, oracle)
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_inference_then_training_then_inference(devices: list[str]) -> None:
    # Copies made without grad are refreshed in place; a call with grad must not use them.
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    with torch.no_grad():
        wrapper(x)
    out = wrapper(x)
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x * 2), oracle(x * 2))
    with torch.inference_mode():
        torch.testing.assert_close(wrapper(x * 3), oracle(x * 3))
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x * 4), oracle(x * 4))
    out.pow(2).sum().backward()
    oracle(x).pow(2).sum().backward()
    _assert_grads(model, oracle)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_training_and_an_evaluation_thread_on_one_wrapper(devices: list[str]) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x, probe = torch.randn(7, 4), torch.randn(5, 4)
    oracle(x).pow(2).sum().backward()
    expected = _grads(oracle)
    with torch.no_grad():
        expected_eval = oracle(probe)
    errors: list[BaseException] = []
    stop = threading.Event()

    def evaluate() -> None:
        try:
            while not stop.is_set():
                with torch.no_grad():
                    torch.testing.assert_close(wrapper(probe), expected_eval)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=evaluate)
    thread.start()
    try:
        for _ in range(40):
            model.zero_grad()
            wrapper(x).pow(2).sum().backward()
            got = _grads(model)
            for name, grad in expected.items():
                torch.testing.assert_close(got[name], grad, msg=name)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[0]


class Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _compile(module: nn.Module) -> Any:
    return torch.compile(module, backend="eager")


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_compiled_child_runs_its_own_copy_on_every_replica(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Compiled()
    oracle = copy.deepcopy(model)
    model.layers[1] = _compile(model.layers[1])
    keys = list(model.state_dict())
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    with pytest.warns(UserWarning, match="compiled submodule") as record:
        wrapper(x)
    # The OptimizedModule's own forward is never a replica's: nothing to rebind or announce.
    assert not [w for w in record if "cannot be rebound" in str(w.message)]
    for _ in range(2):
        wrapper(x)
    # BatchNorm (training) counted one batch per call, from replica 0's chunk: 3 calls
    assert int(model.layers[1]._orig_mod.num_batches_tracked) == 3
    model.eval()
    oracle.eval()
    oracle.load_state_dict({k.replace("._orig_mod", ""): v for k, v in model.state_dict().items()})
    out = wrapper(x)
    torch.testing.assert_close(out, oracle(x))
    assert list(model.state_dict()) == keys
    out.sum().backward()
    oracle(x).sum().backward()
    _assert_grads(model.layers[0], oracle.layers[0])


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_child_compiled_in_place_runs_eagerly_on_the_other_replicas(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Compiled()
    oracle = copy.deepcopy(model)
    model.layers[1].compile(backend="eager")
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    with pytest.warns(UserWarning, match="compiled submodule"):
        wrapper(x)
    wrapper(x)
    assert int(model.layers[1].num_batches_tracked) == 2  # once per call, not per replica
    model.eval()
    oracle.load_state_dict(model.state_dict())
    oracle.eval()
    torch.testing.assert_close(wrapper(x), oracle(x))
    assert model.layers[1]._compiled_call_impl is not None  # the user's module keeps it


def test_a_compiled_root_set_after_construction_is_refused_at_the_call() -> None:
    torch.manual_seed(0)
    wrapper = dp.DataParallel(Compiled(), ["cpu", "cpu"])
    wrapper.module = _compile(Compiled())
    with pytest.raises(TypeError, match=r"compile the wrapper instead"):
        wrapper(torch.randn(4, 4))


class LateHooks(nn.Module):
    """Registers a forward and a backward hook on itself during its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.hooked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.hooked = True
            self.fc.register_forward_hook(lambda m, i, o: o + 1)
            self.fc.register_full_backward_hook(lambda m, gi, go: None)
            self.fc.register_full_backward_pre_hook(lambda m, go: None)
        return self.fc(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_hooks_registered_in_forward_land_once_on_the_module(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = LateHooks()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4, requires_grad=True)  # full backward hooks want an input to follow
    for _ in range(3):
        out = wrapper(x)
        ref = oracle(x)
        out.sum().backward()
        ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for table in ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
        assert len(getattr(model.fc, table)) == len(getattr(oracle.fc, table)) == 1, table
    _assert_grads(model, oracle)


class Helper:
    """A helper object that holds the module it serves (a hook object, a logger)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output


class Config:
    def __init__(self) -> None:
        self.owner: nn.Module | None = None


def _self_referencing(kind: str) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    if kind == "hook object":
        helper = Helper(model)
        model[0].register_forward_hook(helper.hook)
    elif kind == "bound method":
        model[2].register_forward_hook(lambda m, i, o, fn=model.forward: o)
    elif kind == "config object":
        config = Config()
        config.owner = model
        model[1].config = config
    elif kind == "deep closure":
        box = {"levels": [[{"model": model}]]}

        def hook(m: nn.Module, args: Any) -> None:
            box["levels"][0][0]["model"].training  # noqa: B018

        model[0].register_forward_pre_hook(hook)
    elif kind == "tensor hook":
        model.gscale = 0.5
        model[0].weight.register_hook(lambda g: g * model.gscale)
    elif kind == "tensor attribute":
        model[2].bias.owner = model  # type: ignore[attr-defined]
    elif kind == "buffer attribute":
        model[1].register_buffer("steps", torch.zeros(()))
        model[1].steps.owner = model  # type: ignore[attr-defined]
    return model


KINDS = [
    "hook object",
    "bound method",
    "config object",
    "deep closure",
    "tensor hook",
    "tensor attribute",
    "buffer attribute",
]


# The hook object and the closure over a deeply nested box cannot be rebound to each replica:
# announced (tests/replicate/test_rebind.py).
@pytest.mark.filterwarnings("ignore:module. the forward .*cannot be rebound:UserWarning")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_dropped_module_is_freed_whatever_points_back_to_it(
    kind: str, devices: list[str]
) -> None:
    model = _self_referencing(kind)
    ref = weakref.ref(model)
    wrapper = dp.DataParallel(model, devices)
    wrapper(torch.randn(5, 4)).sum().backward()
    replicas = dp.replicate(model, devices)  # the process-wide table too
    replicas[-1](torch.randn(2, 4))
    del model, wrapper, replicas
    gc.collect()
    assert ref() is None


class GradScaled(nn.Module):
    """The issue's module: a tensor hook on a parameter that reads an attribute of the module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gscale = 0.5
        self.lin.weight.register_hook(lambda g: g * self.gscale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("how", ["replicate", "data_parallel"])
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_fresh_modules_with_a_tensor_hook_back_to_them_are_not_kept(
    how: str, devices: list[str]
) -> None:
    refs: list[weakref.ref[nn.Module]] = []
    for _ in range(20):
        model = GradScaled()
        x = torch.randn(5, 4)
        if how == "replicate":
            dp.replicate(model, devices)[-1](x[:2]).sum().backward()
        else:
            dp.data_parallel(model, x, devices).sum().backward()
        refs.append(weakref.ref(model))
        del model
    gc.collect()
    assert [r for r in refs if r() is not None] == []


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_replaced_parameter_is_freed_at_the_next_call(devices: list[str]) -> None:
    model, _ = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(5, 4)
    wrapper(x)
    old = weakref.ref(model.fc.weight)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    wrapper(x)
    gc.collect()
    assert old() is None


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 100).any()):  # a poisoned row: the replica whose chunk holds it fails
            raise ValueError("boom")
        return self.bn(self.fc(x))


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_the_user_module_is_never_written(devices: list[str]) -> None:
    model = Fails()
    forward = model.forward
    keys = list(model.state_dict())
    tensors = {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}
    wrapper = dp.DataParallel(model, devices)
    wrapper(torch.randn(7, 4))
    poisoned = torch.randn(8, 4)
    poisoned[-1] = 1000.0  # the last replica fails
    with pytest.raises(ValueError, match="boom"):
        wrapper(poisoned)
    with torch.no_grad():
        wrapper(torch.randn(6, 4))
    assert model.forward == forward and "forward" not in model.__dict__
    assert list(model.state_dict()) == keys
    assert {k: id(v) for k, v in model.state_dict(keep_vars=True).items()} == tensors
    assert all(not getattr(m, "_is_replica", False) for m in model.modules())


# -- random interleavings -----------------------------------------------------------------------

OPS = st.lists(
    st.sampled_from(
        ["scale", "param", "buffer", "train", "eval", "double", "thread", "nograd", "assign"]
    ),
    min_size=3,
    max_size=8,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS, devices=st.sampled_from(DEVICE_LISTS), batch=st.integers(6, 9))
def test_random_changes_threads_and_double_forwards(
    ops: list[str], devices: list[str], batch: int
) -> None:
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x, y = torch.randn(batch, 4), torch.randn(batch + 1, 4)
    for step, op in enumerate(ops):
        both = (model, oracle)
        with torch.no_grad():
            if op == "scale":
                for m in both:
                    m.scale = 1.0 + step
            elif op == "param":
                for m in both:
                    m.fc.weight.mul_(0.9)
            elif op == "buffer":
                for m in both:
                    m.gain.add_(0.1)
            elif op == "assign":
                new = torch.full((6,), 0.5 + step)
                model._buffers["gain"] = new
                oracle._buffers["gain"] = new.clone()
        if op in ("train", "eval"):
            for m in both:
                m.train(op == "train")
                m.bn.eval()  # batch statistics depend on the split: kept out of this test
        elif op == "double":
            model.zero_grad()
            oracle.zero_grad()
            ((wrapper(x).sum() - wrapper(y).sum()) ** 2).backward()
            ((oracle(x).sum() - oracle(y).sum()) ** 2).backward()
            _assert_grads(model, oracle)
        elif op in ("thread", "nograd"):
            results: list[Any] = []

            def call(results: list[Any] = results) -> None:
                with torch.no_grad(), warnings.catch_warnings():
                    results.append(wrapper(y))

            if op == "thread":
                thread = threading.Thread(target=call)
                thread.start()
                thread.join()
            else:
                call()
            with torch.no_grad():
                torch.testing.assert_close(results[0], oracle(y))


class Holder(nn.Module):
    """A model holding the wrapper as a child (torch.func.functional_call refuses an
    nn.DataParallel as its root, as it refuses torch's own)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_functional_call_through_the_wrapper(devices: list[str]) -> None:
    # torch.func.functional_call swaps tensors into _parameters past torch's setters; every
    # replica must run with them, and gradients reach them.
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    holder = Holder(wrapper)
    x = torch.randn(7, 4)
    holder(x)  # replicas built and cached first
    params = {name: (p.detach() * 1.5).requires_grad_() for name, p in oracle.named_parameters()}
    mine = {f"inner.module.{k}": p.detach().clone().requires_grad_() for k, p in params.items()}
    out = torch.func.functional_call(holder, mine, (x,))
    ref = torch.func.functional_call(oracle, params, (x,))
    torch.testing.assert_close(out, ref)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(mine[f"inner.module.{name}"].grad, p.grad, msg=name)
    torch.testing.assert_close(wrapper(x), oracle(x))  # and the module's own afterwards


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_loader_writing_parameters_directly(devices: list[str]) -> None:
    # accelerate's set_module_tensor_to_device assigns module._parameters[name] = new
    model, oracle = _pair()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    with torch.no_grad():
        wrapper(x)
        for m in (model, oracle):
            m.out._parameters["weight"] = nn.Parameter(torch.full((3, 6), 0.25))
            m.bn._buffers["running_mean"] = torch.full((6,), 0.1)
        torch.testing.assert_close(wrapper(x), oracle(x))
    wrapper(x).sum().backward()
    oracle(x).sum().backward()
    _assert_grads(model, oracle)
