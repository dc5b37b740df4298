"""Calls from two threads at once (issue 29, item 11), and the same seed giving the same result
(item 13).

``dp.data_parallel`` keeps one set of replicas per (module, devices) for all its calls: a
training thread and a ``no_grad`` evaluation thread used to sync and run that one set at once,
and gradients came out wrong on many steps. Every call on one module now takes that module's
lock, as calls through one wrapper do.

Under ``torch.use_deterministic_algorithms(True)`` the replicas that share a random generator
(every CPU replica) run one after another in replica order, so dropout draws the same numbers
for the same seed.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel
from dataparallel.parallel_apply import in_order

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
IDS = ["shared", "copied", "mixed"]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_data_parallel_training_beside_an_evaluation_thread(devices: list[str]) -> None:
    model = net()
    x = torch.randn(12, 16)
    # the reference: the same call with nothing else running (BatchNorm normalises per chunk)
    reference = copy.deepcopy(model)
    dp.data_parallel(reference, x, devices).square().sum().backward()
    want = [p.grad.clone() for p in reference.parameters()]  # type: ignore[union-attr]

    stop = threading.Event()
    failures: list[BaseException] = []

    def evaluate() -> None:
        try:
            while not stop.is_set():
                with torch.no_grad():
                    dp.data_parallel(model, x, devices)
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    evaluator = threading.Thread(target=evaluate, name="evaluator")
    evaluator.start()
    wrong = []
    try:
        for step in range(60):
            model.zero_grad()
            dp.data_parallel(model, x, devices).square().sum().backward()
            got = [p.grad for p in model.parameters()]
            if any(
                g is None or not torch.allclose(g, w, rtol=1e-4, atol=1e-5)
                for g, w in zip(got, want, strict=True)
            ):
                wrong.append(step)
    finally:
        stop.set()
        evaluator.join(60)
    assert not evaluator.is_alive()
    assert not failures, failures[0]
    assert not wrong, f"wrong gradients on steps {wrong}"


# ------------------------------------------------------------------------------ same seed


@pytest.fixture
def deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.5), nn.Linear(256, 256), nn.Dropout(0.5))


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_same_seed_same_result_under_deterministic_algorithms(
    devices: list[str], deterministic: None
) -> None:
    model = dp.DataParallel(dropout_net(), devices)
    x = torch.randn(96, 64)
    torch.manual_seed(123)
    first = model(x)
    for _ in range(15):
        torch.manual_seed(123)
        assert torch.equal(model(x), first)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_deterministic_runs_the_replicas_in_order_on_the_callers_thread(
    devices: list[str], deterministic: None
) -> None:
    seen: list[tuple[int, int]] = []

    class Records(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((int(x[0]), threading.get_ident()))
            return x

    model = dp.DataParallel(Records(), devices)
    model(torch.arange(len(devices) * 2))
    starts = [0, *[sum(model.last_call.chunk_sizes[:i]) for i in range(1, len(devices))]]  # type: ignore[union-attr]
    assert seen == [(s, threading.get_ident()) for s in starts]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_replica_zero_draws_first_as_one_device_would(
    devices: list[str], deterministic: None
) -> None:
    # Replica 0 runs first, so its chunk sees the generator as a one-device call on that chunk.
    model = dropout_net()
    x = torch.randn(96, 64)
    wrapped = dp.DataParallel(model, devices)
    torch.manual_seed(7)
    out = wrapped(x)
    first = wrapped.last_call.chunk_sizes[0]  # type: ignore[union-attr]
    torch.manual_seed(7)
    assert_close_rel(out[:first], model(x[:first]), msg="replica 0")


def test_in_order_says_when_replicas_run_one_after_another(deterministic: None) -> None:
    cpu, cpu1 = torch.device("cpu"), torch.device("cpu", 1)
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert in_order([cpu, cpu1])  # one CPU generator
    assert in_order([gpu0, gpu0])  # one generator on GPU 0
    assert not in_order([gpu0, gpu1])  # a generator each
    assert not in_order([cpu])  # one replica: nothing to order
    torch.use_deterministic_algorithms(False)
    assert not in_order([cpu, cpu1])  # at once, on the pool
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert in_order([cpu, cpu1])  # thread state the workers cannot share
