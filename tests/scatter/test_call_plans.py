"""The functional API's plan reuse (``scatter._plans.CallPlans``, behind ``dp.scatter`` and
``dp.scatter_kwargs``): a reused plan gives the same chunks, warnings and errors as a fresh one,
a changed signature is planned afresh, and the cache keeps no value of a call alive."""

from __future__ import annotations

import copy
import functools
import gc
import importlib
import threading
import types
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import dataparallel as dp
from dataparallel.plan import build_plan
from dataparallel.scatter import take
from dataparallel.scatter._plans import _MAX_PLANS, CallPlans
from scatter.test_plans import _bump, _calls_of_one_signature
from test_roundtrip_properties import Case, assert_same, cases

CPU2 = ["cpu", "cpu"]
CPU = torch.device("cpu")


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> CallPlans:
    """A fresh, empty cache behind ``dp.scatter`` for one test."""
    fresh = CallPlans()
    monkeypatch.setattr(importlib.import_module("dataparallel.scatter._scatter"), "_PLANS", fresh)
    return fresh


def _fresh(args: Any, kwargs: Any, devices: list[str], **opts: Any) -> list[Any]:
    """What ``scatter_kwargs`` gave before the cache: a plan built for this call alone."""
    p = build_plan(args, kwargs, dp.resolve_devices(devices), 0, allow_waves=False, **opts)
    return [take(p, start, length, device) for device, start, length in p.slices[0]]


def _batch(seed: int, size: int = 6) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(size, 3, generator=g),
        [torch.randn(i % 3 + 1, 4, generator=g) for i in range(size)],
        [f"n{seed}-{i}" for i in range(size)],
        dp.Shared(torch.randn(1, 2, generator=g)),
        {"y": torch.randn(size, generator=g)},
    )


def test_a_hit_gives_the_chunks_a_fresh_plan_gives(plans: CallPlans) -> None:
    first, second = _batch(0), _batch(1)
    dp.scatter(first, CPU2)
    assert len(plans.plans) == 1
    got = dp.scatter(second, CPU2)
    assert len(plans.plans) == 1  # the same signature: the kept plan served it
    assert_same(got, [args for args, _ in _fresh(second, None, CPU2)])
    # the second call's own values, not the first's: the same objects where nothing moves
    assert got[0][1][0] is second[1][0] and got[1][2] == second[2][3:]


def test_a_one_argument_call_and_a_tuple_of_it_are_kept_apart(plans: CallPlans) -> None:
    x = torch.randn(4, 2)
    one, wrapped = dp.scatter(x, CPU2), dp.scatter((x,), CPU2)
    assert type(one[0]) is torch.Tensor and type(wrapped[0]) is tuple
    assert len(plans.plans) == 2
    assert type(dp.scatter(x, CPU2)[0]) is torch.Tensor  # a hit keeps the single argument


@pytest.mark.parametrize("options", [{}, {"chunk_sizes": [4, 2]}, {"dtype": torch.float64}])
def test_scatter_kwargs_hits_give_the_fresh_chunks(plans: CallPlans, options: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the calls broadcast a table, and warn each time
        for args, kwargs in _calls_of_one_signature(3):
            got_args, got_kwargs = dp.scatter_kwargs(args, kwargs, CPU2, **options)
            want = _fresh(args, kwargs, CPU2, **options)
            assert_same(list(got_args), [a for a, _ in want])
            assert_same(list(got_kwargs), [k for _, k in want])
    assert len(plans.plans) == 1


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_hit_equals_a_fresh_plan_for_any_batch(case: Case) -> None:
    devices = dp.resolve_devices(["cpu"] * case.n)
    opts = {k: v for k, v in case.opts.items() if k != "max_size"}  # scatter has one round
    cache = CallPlans()
    try:
        cache.get(case.args, case.kwargs, devices, 0, opts)
    except ValueError:  # e.g. chunk sizes that do not fit: nothing is kept, as below
        assert cache.plans == []
        with pytest.raises(ValueError):
            cache.get(case.args, case.kwargs, devices, 0, opts)
        return
    args, kwargs = copy.deepcopy((case.args, case.kwargs))
    _bump((args, kwargs))
    kept = len(cache.plans)
    reused = cache.get(args, kwargs, devices, 0, opts)
    fresh = build_plan(args, kwargs, devices, 0, allow_waves=False, **opts)
    assert len(cache.plans) == kept  # no new entry: a hit, or a call that is never kept
    assert (reused.slices, reused.warnings, reused.batch_size) == (
        fresh.slices,
        fresh.warnings,
        fresh.batch_size,
    )
    for device, start, length in fresh.slices[0]:
        assert_same(take(reused, start, length, device), take(fresh, start, length, device))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (torch.zeros(4, 2), torch.zeros(6, 2)),  # another batch size
        ({"x": torch.zeros(4, 2)}, {"y": torch.zeros(4, 2)}),  # another key
        (["a"] * 4, [1] * 4),  # another item type
        (dp.Split(torch.zeros(4, 4)), dp.Split(torch.zeros(4, 4), dim=1)),  # the marker's dim
        ((torch.zeros(4), torch.zeros(1)), (torch.zeros(4), torch.zeros(4))),  # now batched
    ],
)
def test_a_changed_signature_is_planned_afresh(plans: CallPlans, a: Any, b: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp.scatter(a, CPU2)
        got = dp.scatter(b, CPU2)
        want = [args for args, _ in _fresh(b, None, CPU2)]
    assert len(plans.plans) == 2
    assert_same(got, want)


def test_changed_options_dim_or_devices_are_planned_afresh(plans: CallPlans) -> None:
    x = torch.randn(4, 6)
    assert [c.shape for c in dp.scatter(x, CPU2)] == [(2, 6), (2, 6)]
    assert [c.shape for c in dp.scatter(x, CPU2, dim=1)] == [(4, 3), (4, 3)]
    assert [c.shape for c in dp.scatter(x, ["cpu"] * 3)] == [(2, 6), (1, 6), (1, 6)]
    assert [c.shape for c in dp.scatter(x, CPU2, chunk_sizes=[3, 1])] == [(3, 6), (1, 6)]
    assert [c.dtype for c in dp.scatter(x, CPU2, dtype=torch.float16)] == [torch.float16] * 2
    assert len(plans.plans) == 5


def test_option_values_equal_across_types_are_told_apart(plans: CallPlans) -> None:
    one = torch.randn(1, 2)
    assert [c.shape for c in dp.scatter(one, CPU2, batch_size=1)] == [(1, 2)]
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1"):
        dp.scatter(one, CPU2, batch_size=True)  # True == 1, but a bool is refused
    x = torch.randn(4, 2)
    dp.scatter(x, CPU2, dim=0)
    with pytest.raises(TypeError, match="dim: expected an int"):
        dp.scatter(x, CPU2, dim=False)  # False == 0
    dp.scatter(x, CPU2, weights=[1, 1])
    assert [c.shape[0] for c in dp.scatter(x, CPU2, weights=[1.0, 1.0])] == [2, 2]
    assert len(plans.plans) == 4  # the two weights differ in type: each is kept apart


def test_a_call_that_raises_is_never_kept_and_raises_again(plans: CallPlans) -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="has size 3, expected the batch size 4"):
            dp.scatter((torch.zeros(4), dp.Split(torch.zeros(3))), CPU2, batch_size=4)
        with pytest.raises(ValueError, match="strict=True"):
            dp.scatter((torch.zeros(4), torch.zeros(3)), CPU2, strict=True)
    assert plans.plans == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp.scatter((torch.zeros(4), torch.zeros(3)), CPU2)  # one signature, not strict: warns
    assert len(plans.plans) == 1
    with pytest.raises(ValueError, match="strict=True"):  # kept apart by the option
        dp.scatter((torch.zeros(4), torch.zeros(3)), CPU2, strict=True)


def test_a_hit_warns_as_a_fresh_plan_does_on_every_call(plans: CallPlans) -> None:
    def call() -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dp.scatter((torch.randn(4, 2), torch.randn(3, 2)), CPU2)  # this line is blamed
        return caught

    first, second = call(), call()
    assert len(plans.plans) == 1 and len(first) == 1
    fresh = build_plan(
        (torch.zeros(4, 2), torch.zeros(3, 2)), None, dp.resolve_devices(CPU2), 0
    ).warnings
    for caught in (first, second):
        assert [(w.category, str(w.message)) for w in caught] == [(UserWarning, fresh[0])]
        assert caught[0].filename == __file__
    assert first[0].lineno == second[0].lineno


def test_the_cache_keeps_no_value_of_a_call_alive(plans: CallPlans) -> None:
    batch = _batch(0)
    dp.scatter(batch, CPU2)
    chunks = dp.scatter(batch, CPU2)  # a hit: the plan bound to this call is dropped too
    refs = [weakref.ref(batch[0]), weakref.ref(batch[1][0]), weakref.ref(batch[4]["y"])]
    del batch, chunks
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert len(plans.plans) == 1


def test_a_dict_keyed_by_a_tensor_is_not_kept(plans: CallPlans) -> None:
    key = torch.zeros(1)
    value = torch.randn(4, 2)
    for _ in range(2):
        chunks = dp.scatter({key: value}, CPU2)
        assert [list(c) for c in chunks] == [[key], [key]]
    assert plans.plans == []  # the key would keep the user's tensor alive
    ref = weakref.ref(key)
    del key, chunks
    gc.collect()
    assert ref() is None


def test_keys_equal_across_types_are_never_confused(plans: CallPlans) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for key in (1, True, 1):  # True == 1, but the paths differ: True is never kept
            dp.scatter(({key: torch.zeros(3)}, torch.zeros(4), torch.zeros(4)), CPU2)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3
    assert "args[0][1]" in messages[0] and "args[0][True]" in messages[1]
    assert messages[2] == messages[0]  # a hit
    assert len(plans.plans) == 1


class _Frozen(Mapping[str, Any]):
    """A read-only mapping: the rules rebuild it from its values once, at planning."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = types.MappingProxyType(dict(data))

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_a_mapping_that_is_not_a_dict_is_planned_on_every_call(plans: CallPlans) -> None:
    for _ in range(2):
        chunks = dp.scatter(_Frozen({"x": torch.randn(4, 2)}), CPU2)
        assert [type(c) for c in chunks] == [_Frozen, _Frozen]
    assert plans.plans == []


def test_the_cache_is_bounded(plans: CallPlans) -> None:
    for n in range(2, 2 + 3 * _MAX_PLANS):
        assert [c.shape[0] for c in dp.scatter(torch.zeros(n, 2), CPU2)] == [
            (n + 1) // 2,
            n // 2,
        ]
    assert len(plans.plans) == _MAX_PLANS


def test_concurrent_calls_each_get_their_own_chunks(plans: CallPlans) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(seed: int) -> None:
        try:
            barrier.wait()
            for step in range(30):
                size = 2 + (seed + step) % 12  # signatures shared between the threads
                batch = _batch(seed * 1000 + step, size)
                got = dp.scatter(batch, CPU2)
                assert_same(got, [args for args, _ in _fresh(batch, None, CPU2)])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(plans.plans) <= _MAX_PLANS


def test_the_callers_option_lists_are_neither_kept_nor_trusted(plans: CallPlans) -> None:
    x = torch.randn(4, 2)
    sizes = [3, 1]
    assert [c.shape[0] for c in dp.scatter(x, CPU2, chunk_sizes=sizes)] == [3, 1]
    kept = plans.plans[0][1].remake
    assert isinstance(kept, functools.partial)
    assert kept.keywords["chunk_sizes"] == [3, 1] and kept.keywords["chunk_sizes"] is not sizes
    sizes[:] = [1, 3]  # the same list, new values: another key
    assert [c.shape[0] for c in dp.scatter(x, CPU2, chunk_sizes=sizes)] == [1, 3]
    assert len(plans.plans) == 2
