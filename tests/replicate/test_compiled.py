"""``dataparallel.replicate._compiled``: ``compile=`` compiles every replica; a module
compiled as a whole is not replicated; ``torch.compile(wrapper)`` says what to do instead.

A ``torch.compile`` result's forward is bound to the original module, so replicas of it would
all run that one module; ``DataParallel`` refuses it over two or more replicas and names the
fix (``compile=True``), and accepts it on one (the module itself runs, as on one device).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel
from dataparallel.replicate._compiled import check_not_compiled, compiled_class

CPU2 = [torch.device("cpu")] * 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_a_torch_compile_result_is_refused_over_two_replicas() -> None:
    compiled = torch.compile(_model(), backend="eager")
    assert compiled_class() is type(compiled)
    with pytest.raises(TypeError, match=r"torch\.compile\(\.\.\.\) result") as info:
        dp.DataParallel(compiled, CPU2)
    assert "dp.DataParallel(model, devices, compile=True)" in str(info.value)
    assert "over 2 replicas" in str(info.value)


def test_a_module_compiled_in_place_is_refused_over_two_replicas() -> None:
    model = _model()
    model.compile(backend="eager")
    with pytest.raises(TypeError, match=r"compiled in place with module\.compile\(\)"):
        dp.DataParallel(model, CPU2)


def test_a_module_compiled_after_wrapping_is_refused_at_the_next_call() -> None:
    model = _model()
    wrapper = dp.DataParallel(model, CPU2)
    x = torch.randn(6, 4)
    wrapper(x)
    model.compile(backend="eager")
    with pytest.raises(TypeError, match="compiled in place"):
        wrapper(x)


def test_one_replica_runs_the_compiled_module_as_on_one_device() -> None:
    model = _model()
    x = torch.randn(6, 4)
    expected = model(x)
    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(dp.DataParallel(compiled, ["cpu"])(x), expected)


def test_eager_modules_and_compiled_children_pass() -> None:
    model = _model()
    check_not_compiled(model, CPU2)
    model[0] = torch.compile(model[0], backend="eager")  # a child: each replica copies it
    check_not_compiled(model, CPU2)


# -- compile=: every replica's forward compiled ---------------------------------------------

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


class Counting:
    """A torch.compile backend that counts the graphs it is given and runs them as traced."""

    def __init__(self) -> None:
        self.graphs: list[int] = []  # call_module/call_function nodes per graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs.append(sum(n.op in ("call_function", "call_module") for n in gm.graph.nodes))
        return gm.forward


@pytest.mark.parametrize("devices", DEVICE_LISTS)
def test_compile_compiles_every_replica_once_and_trains_as_one_device(
    devices: list[str],
) -> None:
    torch._dynamo.reset()
    backend = Counting()
    model = _model()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices, compile={"backend": backend})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(7, 4, generator=gen)
        out, ref = wrapper(x), oracle(x)
        assert_close_rel(out, ref, msg=f"step {step} output")
        out.pow(2).mean().backward()
        ref.pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
            assert_close_rel(p.grad, q.grad, msg=f"step {step} {name}")  # type: ignore[arg-type]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if step == 0:
            first = list(backend.graphs)
    # at most one graph per replica, each with every layer (3 modules' ops), none made again
    assert 1 <= len(first) <= len(devices) and all(n >= 3 for n in first)
    assert backend.graphs == first
    # the user's module is not changed: not compiled in place, same keys
    assert model.__dict__.get("_compiled_call_impl") is None
    assert list(model.state_dict()) == list(oracle.state_dict())
    assert list(wrapper.state_dict()) == [f"module.{k}" for k in oracle.state_dict()]


def test_compile_on_one_device_compiles_the_module_itself() -> None:
    torch._dynamo.reset()
    backend = Counting()
    model = _model()
    x = torch.randn(5, 4)
    out = dp.DataParallel(model, ["cpu"], compile={"backend": backend})(x)
    torch.testing.assert_close(out, model(x))
    assert len(backend.graphs) == 1 and type(model) is nn.Sequential


@pytest.mark.parametrize("devices", [["cpu"], CPU2, ["cpu", "cpu:1", "cpu:1"]], ids=str)
def test_a_hook_added_after_the_first_call_runs_on_every_list(devices: list[str]) -> None:
    """Issue 50, item 8: on a one-device list the compiled module itself ran its first graph
    after a forward hook was registered (output off by 0.80); two and three replicas were
    right. Every list recompiles on a hook added, and again on its removal."""
    torch._dynamo.reset()
    model = _model()
    wrapper = dp.DataParallel(model, devices, compile={"backend": "eager"})
    x = torch.randn(6, 4)
    assert_close_rel(wrapper(x), model(x))
    handle = model[-1].register_forward_hook(lambda mod, args, out: out * 2)
    pre = model[0].register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    assert_close_rel(wrapper(x), model(x), msg="after the hooks were added")
    handle.remove()
    pre.remove()
    assert_close_rel(wrapper(x), model(x), msg="after they were removed")


def test_compile_options_are_checked_at_construction() -> None:
    assert dp.DataParallel(_model(), CPU2, compile=True).compile_options == {}
    assert dp.DataParallel(_model(), CPU2).compile_options is None
    with pytest.raises(TypeError, match=r"compile: expected True, False or a dict"):
        dp.DataParallel(_model(), CPU2, compile="inductor")  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"compile: torch.compile refused .*no_such_backend"):
        dp.DataParallel(_model(), CPU2, compile={"backend": "no_such_backend"})


def test_a_copied_wrapper_keeps_compile() -> None:
    torch._dynamo.reset()
    backend = Counting()
    wrapper = dp.DataParallel(_model(), CPU2, compile={"backend": backend})
    wrapper(torch.randn(4, 4))
    again = copy.deepcopy(wrapper)
    copied = again.compile_options["backend"]  # deepcopy copied the backend object too
    assert isinstance(copied, Counting) and copied is not backend
    before = len(copied.graphs)
    x = torch.randn(4, 4)
    torch.testing.assert_close(again(x), again.module(x))
    assert len(copied.graphs) > before  # the copy compiles its own replicas


def _matching(rec: pytest.WarningsRecorder, pattern: str) -> list[str]:
    """The recorded warnings whose message matches ``pattern`` (as ``pytest.warns`` does)."""
    return [str(w.message) for w in rec if re.search(pattern, str(w.message))]


def test_compiling_the_wrapper_warns_once_with_the_fix_and_runs_eagerly() -> None:
    """torch.compile(wrapper) cannot trace the pipeline: it used to graph-break into tiny
    graphs with dynamo's warnings; now it compiles nothing, warns once naming compile=, and
    gives the one-device result."""
    torch._dynamo.reset()
    backend = Counting()
    model = _model()
    compiled = torch.compile(dp.DataParallel(model, CPU2), backend=backend)
    x = torch.randn(6, 4)
    ours = r"compiles none of the model.*compile=True"
    with pytest.warns(UserWarning, match=ours) as rec:
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
    # Only ours are counted: torch adds its own (on 3.13.0, "Guards may run slower").
    assert len(_matching(rec, ours)) == 1, [str(w.message) for w in rec]
    assert backend.graphs == []


def test_compiling_a_wrapper_made_with_compile_says_it_adds_nothing() -> None:
    torch._dynamo.reset()
    backend = Counting()
    model = _model()
    wrapper = dp.DataParallel(model, ["cpu", "cpu:1"], compile={"backend": backend})
    outer = torch.compile(wrapper, backend="eager")
    x = torch.randn(6, 4)
    ours = r"adds nothing.*drop the outer torch.compile"
    with pytest.warns(UserWarning, match=ours) as rec:
        for _ in range(2):
            torch.testing.assert_close(outer(x), model(x))
    assert len(_matching(rec, ours)) == 1, [str(w.message) for w in rec]
    assert 1 <= len(backend.graphs) <= 2  # the replicas are compiled all the same


@pytest.mark.parametrize("devices", DEVICE_LISTS)
@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook", "swapped hook"])
def test_compile_sees_hooks_changed_after_the_first_call(kind: str, devices: list[str]) -> None:
    """dynamo does not guard on module hooks: the wrapper compiles again after a hook of the
    tree changed, so every replica (device 0 included) runs it, as one device does."""
    torch._dynamo.reset()
    model = _model()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices, compile={"backend": "eager"})
    x = torch.randn(7, 4)
    assert_close_rel(wrapper(x), oracle(x), msg="before the hook")
    handles = []
    for net in (model, oracle):
        if kind == "forward pre-hook":
            net[0].register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
        else:
            handles.append(net[0].register_forward_hook(lambda m, i, o: o + 1.0))
    assert_close_rel(wrapper(x), oracle(x), msg=f"after the {kind}")
    if kind == "swapped hook":
        for net, handle in zip((model, oracle), handles, strict=True):
            handle.remove()
            net[0].register_forward_hook(lambda m, i, o: o - 3.0)
        assert_close_rel(wrapper(x), oracle(x), msg="after the swap")


@pytest.mark.parametrize("devices", [["cpu"], CPU2], ids=str)
def test_a_global_hook_registered_after_the_first_call_runs(devices: list[str]) -> None:
    """Issue 60, item 9: a global forward hook (``register_module_forward_hook``) registered
    after the first calls never ran under ``compile=`` (off by 0.648): dynamo guards on
    neither kind of hook. Every list recompiles on one added, and on its removal."""
    torch._dynamo.reset()
    model = _model()
    wrapper = dp.DataParallel(model, devices, compile={"backend": "eager"})
    x = torch.randn(6, 4)
    assert_close_rel(wrapper(x), model(x))

    def double(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 2 if mod is model[-1] or type(mod) is type(model[-1]) else out

    handle = nn.modules.module.register_module_forward_hook(double)
    try:
        want = model(x)
        assert_close_rel(wrapper(x), want, msg="after the global hook was added")
    finally:
        handle.remove()
    assert_close_rel(wrapper(x), model(x), msg="after it was removed")
