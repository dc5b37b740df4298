"""A DataParallel inside a wrapped module (issue 29, item 1): it runs right or is refused at
once, and never hangs.

A warm inner wrapper (one that has run) used to share its lock and replica sets with its
replica copies, so the second outer call waited for good on a pool worker blocked on that lock.
Now each copy has its own (``DataParallel._replicate_for_data_parallel``) and runs its chunk on
its replica's device; the wrapper itself (replica 0) splits its chunk over its own devices. The
oracle is the same module run plainly on one device, inner wrappers unwrapped.

Every call that could hang runs in a daemon thread joined with a timeout, so a regression
fails instead of hanging the suite.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
IDS = ["shared", "copied", "mixed"]
JOIN_S = 30.0


def no_hang(fn: Callable[[], Any]) -> Any:
    """``fn()``, run in a daemon thread: a call still running after ``JOIN_S`` fails the test."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="nested-call")
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive(), f"the call hung (still running after {JOIN_S:.0f} s)"
    if "error" in result:
        raise result["error"]
    return result["value"]


class Holder(nn.Module):
    """A model holding a wrapped submodule, as ``model.encoder = dp.DataParallel(enc)``."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def unwrapped(model: Holder) -> Holder:
    """The oracle: the same model with its inner wrapper replaced by the wrapped module."""
    plain = copy.deepcopy(model)
    if isinstance(plain.encoder, dp.DataParallel):
        plain.encoder = plain.encoder.module
    return plain


# No word either: the inner wrapper's per-call state (a thread-local, dicts it writes) is a
# library's, not the model's, however this library is installed (an editable one too).
@pytest.mark.filterwarnings("error::UserWarning")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("inner", DEVICE_LISTS, ids=IDS)
@pytest.mark.parametrize("outer", DEVICE_LISTS, ids=IDS)
def test_nested_wrapper_runs_as_one_device(outer: list[str], inner: list[str], warm: bool) -> None:
    torch.manual_seed(0)
    model = Holder(dp.DataParallel(nn.Linear(4, 6), inner))
    x = torch.randn(9, 4)
    if warm:
        model.encoder(x)  # the inner wrapper has run once: its lock and replicas exist
    plain = unwrapped(model)
    wrapped = dp.DataParallel(model, outer)
    want = plain(x)
    want.sum().backward()
    for call in range(3):  # the second call is the one that hung
        model.zero_grad()
        out = no_hang(lambda: wrapped(x))
        out.sum().backward()
        assert_close_rel(out, want, msg=f"call {call}: output")
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert p.grad is not None, f"call {call}: {name} got no gradient"
            assert_close_rel(p.grad, q.grad, msg=f"call {call}: grad of {name}")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_wrapper_in_a_wrapper_under_no_grad_and_from_two_threads(devices: list[str]) -> None:
    # A wrapper whose module is itself a (warm) wrapper, called from two threads at once.
    torch.manual_seed(1)
    inner = dp.DataParallel(nn.Linear(4, 3), devices)
    x = torch.randn(8, 4)
    want = inner.module(x).detach()
    inner(x)
    outer = dp.DataParallel(nn.Sequential(inner), devices)

    def many() -> list[torch.Tensor]:
        with torch.no_grad():
            return [outer(x) for _ in range(20)]

    results: list[list[torch.Tensor]] = []
    threads = [threading.Thread(target=lambda: results.append(many())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S * 2)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert len(results) == 2
    for out in (o for r in results for o in r):
        assert_close_rel(out, want, msg="output")


class Shares(nn.Module):
    """Holds a wrapper outside its module tree (in a plain list): every replica shares it."""

    def __init__(self, wrapper: dp.DataParallel) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hidden = [wrapper]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden[0](self.lin(x))


@pytest.mark.timeout(120)
def test_a_wrapper_shared_outside_the_tree_runs_or_is_refused_never_hangs() -> None:
    # Replica 0 (the caller) may hold the shared wrapper's lock while a worker's replica asks
    # for it: waiting there could hang for good, so the worker refuses at once, naming the fix.
    # Which thread comes first is up to the scheduler: either outcome is right, a hang is not.
    torch.manual_seed(2)
    inner = dp.DataParallel(nn.Linear(4, 3), ["cpu", "cpu"])
    model = Shares(inner)
    x = torch.randn(8, 4)
    inner(x)
    want = inner.module(model.lin(x))
    wrapped = dp.DataParallel(model, ["cpu", "cpu"])
    for _ in range(10):
        try:
            out = no_hang(lambda: wrapped(x))
        except RuntimeError as exc:
            assert "Register it as a submodule" in str(exc)
        else:
            assert_close_rel(out, want, msg="output")


@pytest.mark.timeout(120)
def test_a_worker_is_refused_a_busy_wrapper_at_once() -> None:
    # Deterministic form of the case above: the caller holds the shared wrapper's lock for the
    # whole outer call, so the worker's replica always finds it busy.
    inner = dp.DataParallel(nn.Linear(4, 4), ["cpu", "cpu"])

    class Holds(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 4:  # replica 0's chunk, on the caller's thread: hold the lock
                with inner._call_lock():
                    started.set()
                    finished.wait(JOIN_S)
                return x
            started.wait(JOIN_S)  # replica 1, on a pool worker, while the caller holds it
            try:
                return inner(x)
            finally:
                finished.set()

    started, finished = threading.Event(), threading.Event()
    wrapped = dp.DataParallel(Holds(), ["cpu", "cpu"], chunk_sizes=[4, 3])
    with pytest.raises(RuntimeError, match="busy with a call on another thread"):
        no_hang(lambda: wrapped(torch.randn(7, 4)))


def test_a_replica_copy_keeps_nothing_of_the_wrappers_runtime() -> None:
    inner = dp.DataParallel(nn.Linear(4, 3), ["cpu", "cpu"])
    inner(torch.randn(4, 4))
    copy_ = inner._replicate_for_data_parallel()
    for name in ("_lock", "_replica_sets", "_calls", "_plans", "_sentinels"):
        assert name in inner.__dict__
        assert name not in copy_.__dict__
    assert copy_._call_lock() is not inner._call_lock()
