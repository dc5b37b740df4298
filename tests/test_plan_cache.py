"""The wrapper's plan reuse: a reused plan behaves exactly as a fresh one would.

Each test calls a wrapper twice or more, so the second call takes the cached plan, and checks
the result against the oracle (the plain module on one device) or against what a freshly built
plan says.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.plan import build_plan
from dataparallel.plan._cache import PlanCache, signature
from dataparallel.scatter import take

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
    assert model.__dict__["_plans"].entry is not None  # the calls above were cacheable


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


def test_keyword_names_and_dtypes_are_part_of_the_signature() -> None:
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
    assert signature((x,), {}) != signature((x.double(),), {})
    assert signature((x,), {"y": x}) != signature((x, x), {})


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


@pytest.mark.parametrize(
    "inputs",
    [([torch.zeros(2, 1)],), (dp.Shared(torch.zeros(2)),), (np.zeros((2, 1)),), (3,)],
)
def test_only_plain_tensor_calls_are_cached(inputs: tuple) -> None:
    assert signature(inputs, {}) is None


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


@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_flat_chunks_of_a_bare_plan_equal_take(dtype: torch.dtype | None) -> None:
    from dataparallel.plan._cache import take_flat

    cache = PlanCache()
    devices = [torch.device("cpu"), torch.device("cpu", 1), torch.device("cpu")]
    options = {"max_size": 2, "dtype": dtype}
    call = ((torch.randn(10, 2), torch.zeros(3)), {"k": torch.ones(10, dtype=torch.int64)})
    cache.get(*call, devices, 0, options)
    x, table, k = torch.randn(10, 2), torch.randn(3), torch.arange(10)
    bare = cache.get((x, table), {"k": k}, devices, 0, options, bare=True)
    fresh = build_plan((x, table), {"k": k}, devices, 0, **options)
    assert bare.slices == fresh.slices and len(bare.slices) > 1
    for wave in fresh.slices:
        flat_args, flat_kws = take_flat(bare, wave, (x, table), {"k": k})
        for (d, s, n), fa, fk in zip(wave, flat_args, flat_kws, strict=True):
            ta, tk = take(fresh, s, n, d)
            assert type(fa) is tuple and len(fa) == len(ta) == 2
            for p, q in [*zip(fa, ta, strict=True), (fk["k"], tk["k"])]:
                assert p.dtype == q.dtype and p.device == q.device and torch.equal(p, q)
            if d == torch.device("cpu") and dtype is None:  # a broadcast in place: not copied
                assert fa[1] is table


def test_a_bare_one_chunk_plan_in_place_moves_nothing() -> None:
    cache = PlanCache()
    one = [torch.device("cpu")]
    cache.get((torch.randn(4, 2),), {}, one, 0, {})
    assert "moves_nothing" in cache.get((torch.randn(4, 2),), {}, one, 0, {}, bare=True).__dict__
    cast = {"dtype": torch.float64}
    cache.get((torch.randn(4, 2),), {}, one, 0, cast)
    assert (
        "moves_nothing" not in cache.get((torch.randn(4, 2),), {}, one, 0, cast, bare=True).__dict__
    )
