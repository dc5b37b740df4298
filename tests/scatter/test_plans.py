"""The wrapper's plan reuse: a reused plan behaves exactly as a fresh one would.

Each test calls a wrapper twice or more, so the second call takes the cached plan, and checks
the result against the oracle (the plain module on one device) or against what a freshly built
plan says.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import warnings
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import dataparallel as dp
from dataparallel.plan import build_plan
from dataparallel.scatter import take
from dataparallel.scatter._plans import PlanCache, call_key
from test_roundtrip_properties import Case, assert_same, cases

CPU2 = ["cpu", "cpu"]
CPU3 = ["cpu", "cpu", "cpu"]


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.lin(x)
        return out if y is None else out + y.sum()


def test_a_second_call_uses_the_new_inputs_values() -> None:
    torch.manual_seed(0)
    module = Pair()
    model = dp.DataParallel(module, CPU2)
    for _ in range(3):
        x = torch.randn(6, 4)
        torch.testing.assert_close(model(x), module(x), atol=1e-5, rtol=0)
    assert len(model.__dict__["_plans"].plans) == 1  # one signature, one kept plan


def test_a_new_batch_size_gets_a_new_plan() -> None:
    model = dp.DataParallel(Pair(), CPU3)
    model(torch.randn(9, 4))
    assert model.last_call.chunk_sizes == [3, 3, 3]
    out = model(torch.randn(4, 4))
    assert out.shape == (4, 3) and model.last_call.chunk_sizes == [2, 1, 1]
    model(torch.randn(2, 4))  # fewer samples than devices: fewer devices
    assert model.last_call.devices == ["cpu", "cpu"]


def test_a_broadcast_input_stays_broadcast_and_warns_once_per_wrapper() -> None:
    torch.manual_seed(0)
    module = Pair()
    model = dp.DataParallel(module, CPU2)
    x, y = torch.randn(6, 4), torch.randn(5, 2)  # y's size 5 is not the batch size 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(model(x, y), module(x, y), atol=1e-5, rtol=0)
    assert sum("broadcast" in str(w.message) for w in caught) == 1


def test_keyword_names_are_part_of_the_key_and_a_new_dtype_is_still_right() -> None:
    torch.manual_seed(0)
    module = Pair()
    model = dp.DataParallel(module, CPU2)
    x = torch.randn(4, 4)
    model(x, torch.zeros(4, 3))
    # same shapes, the second tensor now a keyword: a different call
    fresh = dp.DataParallel(module, CPU2)  # no plan cached yet: the reference
    torch.testing.assert_close(model(x, y=torch.ones(4, 3)), fresh(x, y=torch.ones(4, 3)))
    double = dp.DataParallel(module.double(), CPU2)
    out = double(x.double())
    assert out.dtype == torch.float64
    assert call_key((x,), {"y": x}, 0, False) != call_key((x, x), {}, 0, False)
    assert call_key((x,), {}, 0, False) != call_key((x[:3],), {}, 0, False)
    # a tensor's device is part of a one-device key (its plan may move nothing)
    assert call_key((x,), {}, 0, True) != call_key((x.to("meta"),), {}, 0, True)


def test_the_dtype_option_still_casts_on_a_reused_plan() -> None:
    seen: list[torch.dtype] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            seen.append(x.dtype)
            assert labels.dtype == torch.int64  # integer inputs are never cast
            return x.float().sum(1)

    model = dp.DataParallel(Probe(), CPU2, dtype=torch.float64)
    for _ in range(2):
        model(torch.randn(4, 3), torch.arange(4))
    assert seen == [torch.float64] * 4


def test_changed_options_or_devices_give_a_new_plan() -> None:
    model = dp.DataParallel(Pair(), CPU2)
    x = torch.randn(8, 4)
    model(x)
    assert model.last_call.chunk_sizes == [4, 4]
    model.options["chunk_sizes"] = [2, 6]
    model(x)
    assert model.last_call.chunk_sizes == [2, 6]
    model.options["chunk_sizes"] = np.array([6, 2])  # not cached, still right
    model(x)
    assert model.last_call.chunk_sizes == [6, 2]
    model.options["chunk_sizes"] = None
    model.device_ids = [torch.device("cpu")] * 3
    model(x)
    assert model.last_call.chunk_sizes == [3, 3, 2]


def test_gradients_flow_to_inputs_through_a_reused_plan() -> None:
    torch.manual_seed(0)
    module = Pair()
    model = dp.DataParallel(module, CPU2)
    for _ in range(2):
        x = torch.randn(6, 4, requires_grad=True)
        model(x).pow(2).sum().backward()
        ref = x.detach().clone().requires_grad_()
        module(ref).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad, atol=1e-5, rtol=0)


def test_the_cache_keeps_no_batch_alive() -> None:
    cache = PlanCache()
    x = torch.randn(6, 4)
    plan = cache.get((x,), {}, [torch.device("cpu")] * 2, 0, {"batch_size": None})
    ref = weakref.ref(x)
    del x, plan
    gc.collect()
    assert ref() is None


def test_a_reused_plan_equals_a_fresh_one() -> None:
    cache = PlanCache()
    devices = [torch.device("cpu")] * 3
    options = {"max_size": 2, "strict": False}
    a, b = torch.randn(10, 2), torch.randn(10, 2)
    cache.get((a, torch.zeros(3)), {"k": torch.ones(10)}, devices, 0, options)
    reused = cache.get((b, torch.ones(3)), {"k": torch.zeros(10)}, devices, 0, options)
    fresh = build_plan((b, torch.ones(3)), {"k": torch.zeros(10)}, devices, 0, **options)
    assert reused.slices == fresh.slices and reused.waves == fresh.waves
    assert reused.warnings == fresh.warnings and reused.batch_size == fresh.batch_size
    chunks_reused = [take(reused, s, n, d) for d, s, n in reused.slices[0]]
    chunks_fresh = [take(fresh, s, n, d) for d, s, n in fresh.slices[0]]
    for (ra, rk), (fa, fk) in zip(chunks_reused, chunks_fresh, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(ra, fa, strict=True))
        assert rk.keys() == fk.keys() and all(torch.equal(rk[k], fk[k]) for k in rk)


def _calls_of_one_signature(seed: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Two calls whose arguments differ in values only: containers, lists, markers, arrays."""
    calls = []
    for k in range(2):
        g = torch.Generator().manual_seed(seed * 10 + k)
        x = torch.randn(6, 4, generator=g)
        batch = {
            "x": x,
            "mask": torch.ones(6, 3),
            "names": [f"s{i}{k}" for i in range(6)],
            "boxes": [torch.randn(i + 1, 4, generator=g) for i in range(6)],
            "pair": (torch.randn(6, 2, generator=g), None),
            "table": torch.randn(20, 4, generator=g),  # not batched: broadcast, warned
        }
        extra = [torch.randn(6, 1, generator=g), torch.randn(6, 1, generator=g)]
        kwargs = {
            "arr": np.full((6, 2), k),
            "shared": dp.Shared([torch.randn(3, generator=g)]),
            "split": dp.Split([f"t{k}{i}" for i in range(6)]),
            "flag": bool(k),
        }
        calls.append(((batch, extra, 3), kwargs))
    return calls


@pytest.mark.parametrize("options", [{}, {"max_size": 2}, {"dtype": torch.float64}])
@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu:1", "cpu"]])
def test_a_reused_plan_of_containers_equals_a_fresh_one(
    options: dict[str, Any], devices: list[str]
) -> None:
    cache = PlanCache()
    resolved = dp.resolve_devices(devices)
    first, second = _calls_of_one_signature(0)
    assert call_key(*first, 0, False) == call_key(*second, 0, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache.get(*first, resolved, 0, options)
        reused = cache.get(*second, resolved, 0, options)
        fresh = build_plan(*second, resolved, 0, **options)
    assert len(cache.plans) == 1 and reused.leaf_rules is None  # served by the cache
    assert (reused.slices, reused.waves, reused.warnings, reused.votes) == (
        fresh.slices,
        fresh.waves,
        fresh.warnings,
        fresh.votes,
    )
    assert str(reused) == str(fresh)  # the rows of a reused plan are this call's
    for wave in fresh.slices:
        for device, start, length in wave:
            got, want = take(reused, start, length, device), take(fresh, start, length, device)
            assert_same(got, want)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"x": torch.zeros(4, 2)}, {"y": torch.zeros(4, 2)}),  # another key
        ([torch.zeros(4, 2)] * 3, [torch.zeros(4, 2)] * 4),  # another length
        ([torch.zeros(4, 2)] * 3, [torch.zeros(3, 2)] * 3),  # a tensor list's common size
        (["a"] * 4, [1] * 4),  # another item type
        ([{"t": torch.zeros(1)}] * 3, [{"t": 1}] * 3),  # tensors inside items, or not
        (dp.Split(torch.zeros(4, 2)), dp.Split(torch.zeros(4, 2), dim=1)),  # the marker's dim
        (np.zeros((4, 2)), torch.zeros(4, 2)),  # an ndarray is not a tensor
        ((torch.zeros(4),), [torch.zeros(4)]),  # a tuple is not a list
    ],
)
def test_what_the_rules_read_is_part_of_the_key(a: Any, b: Any) -> None:
    assert call_key((a,), {}, 0, False) is not None
    assert call_key((a,), {}, 0, False) != call_key((b,), {}, 0, False)


def test_a_call_that_cannot_be_keyed_is_planned_afresh() -> None:
    loop: list[Any] = [torch.zeros(2)]
    loop.append(loop)  # a cycle: the rules name it
    assert call_key((loop,), {}, 0, False) is None
    model = dp.DataParallel(Pair(), CPU2)
    with pytest.raises(ValueError, match="contains itself"):
        model(torch.randn(4, 4), y=loop)
    assert model.__dict__["_plans"].plans == []


def test_the_cache_keeps_no_container_batch_alive() -> None:
    cache = PlanCache()
    x = torch.randn(6, 4)
    boxes = [torch.randn(i + 1, 4) for i in range(6)]  # a per-sample list
    for _ in range(2):
        plan = cache.get(({"x": x, "boxes": boxes},), {}, dp.resolve_devices(CPU2), 0, {})
    refs = [weakref.ref(x), weakref.ref(boxes[0])]
    del x, boxes, plan
    gc.collect()
    assert [r() for r in refs] == [None, None]


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.5)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)) * self.scale


def test_module_changes_between_calls_of_one_signature_are_seen() -> None:
    # The plan is reused on every call below (same shapes); the module's state is not part of
    # it, so each change must show in the very next call, as on one device.
    torch.manual_seed(0)
    module = Stateful().eval()
    model = dp.DataParallel(module, CPU3)
    x = torch.randn(6, 4)

    def check() -> None:
        with torch.no_grad():
            torch.testing.assert_close(model(x), module(x), atol=1e-5, rtol=0)

    check()
    module.scale = 3.0  # a plain attribute
    check()
    with torch.no_grad():
        module.lin.weight.mul_(2)  # an in-place parameter change
    check()
    module.lin.weight.data = module.lin.weight.data + 1  # through .data
    check()
    handle = module.lin.register_forward_hook(lambda m, i, o: o + 1)  # a new hook
    check()
    handle.remove()
    module.lin = nn.Linear(4, 3)  # a replaced submodule
    check()
    module.double()  # .to(): a new dtype, which is also a new signature for the inputs
    x = x.double()
    check()
    module.train()  # dropout on: outputs differ per chunk, but the flag must reach replicas
    with torch.no_grad():
        out = model(x)
    assert (out == 0).any()  # dropout zeroed something: the replicas are in training mode


def test_a_one_chunk_plan_in_place_is_the_identity_program() -> None:
    cache = PlanCache()
    one = [torch.device("cpu")]
    x = torch.randn(4, 2)
    for _ in range(2):
        plan = cache.get((x,), {"m": x}, one, 0, {})
        assert plan.program is not None and plan.program.identity
        args, kwargs = take(plan, 0, 4, one[0])
        assert args[0] is x and kwargs["m"] is x
    cast = {"dtype": torch.float64}
    assert not cache.get((x,), {}, one, 0, cast).program.identity  # a cast is a move
    two = cache.get((x,), {}, [torch.device("cpu")] * 2, 0, {})
    assert not two.program.identity  # two chunks
    boxed = cache.get(({"x": x},), {}, one, 0, {})
    assert not boxed.program.identity  # a container is rebuilt


def _bump(obj: Any) -> None:
    """Change every floating-point tensor and ndarray in ``obj`` in place (a new call's values)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            obj.add_(1.0)
    elif isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f":
            obj += 1.0
    elif isinstance(obj, dp.Shared):
        _bump(obj.obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _bump(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _bump(value)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _bump(getattr(obj, f.name))


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_reused_plan_equals_a_fresh_one_for_any_batch(case: Case) -> None:
    devices = dp.resolve_devices(["cpu"] * case.n)
    cache = PlanCache()
    first = cache.get(case.args, case.kwargs, devices, 0, case.opts)
    args, kwargs = copy.deepcopy((case.args, case.kwargs))
    _bump((args, kwargs))
    reused = cache.get(args, kwargs, devices, 0, case.opts)
    fresh = build_plan(args, kwargs, devices, 0, **case.opts)
    assert first.leaf_rules is not None and reused.leaf_rules is None  # a cache hit
    assert (reused.slices, reused.waves, reused.warnings, reused.votes) == (
        fresh.slices,
        fresh.waves,
        fresh.warnings,
        fresh.votes,
    )
    for wave in fresh.slices:
        for device, start, length in wave:
            assert_same(take(reused, start, length, device), take(fresh, start, length, device))
