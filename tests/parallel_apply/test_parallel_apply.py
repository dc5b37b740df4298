"""parallel_apply: the pool, context replay, errors, nesting.

Oracle pattern: outputs are compared with applying the same modules one after another in the
test's own thread.
"""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from dataparallel.parallel_apply import describe_inputs, parallel_apply
from dataparallel.parallel_apply._pool import THREAD_PREFIX
from dataparallel.replicate import replicate

CPU3 = ["cpu", "cpu", "cpu"]


def _pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}


class Recorder(nn.Module):
    """Returns what it saw: its thread, grad mode, autocast state and argument kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        x = args[0] if isinstance(args[0], torch.Tensor) else torch.ones(1, 4)
        return {
            "out": self.lin(x),
            "thread": threading.current_thread().name,
            "grad": torch.is_grad_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "autocast_dtype": torch.get_autocast_dtype("cpu"),
            "nargs": len(args),
            "arg_types": [type(a).__name__ for a in args],
            "kwargs": sorted(kwargs),
        }


def test_outputs_equal_sequential_application() -> None:
    torch.manual_seed(0)
    modules = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(3)]
    inputs = [torch.randn(n, 4) for n in (5, 4, 3)]
    outs = parallel_apply(modules, inputs, devices=CPU3)
    expected = [m(x) for m, x in zip(modules, inputs, strict=True)]
    for o, e in zip(outs, expected, strict=True):
        torch.testing.assert_close(o, e)


def test_runs_on_named_pool_threads_reused_across_calls() -> None:
    modules = [Recorder() for _ in range(3)]
    first = parallel_apply(modules, [torch.randn(2, 4)] * 3, devices=CPU3)
    # Replica 0 runs on the caller's thread; the others on their slot's worker.
    caller = threading.current_thread().name
    assert [o["thread"] for o in first] == [
        caller,
        f"{THREAD_PREFIX}cpu-1",
        f"{THREAD_PREFIX}cpu-2",
    ]
    threads = _pool_threads()
    assert all(t.daemon for t in threads)
    for _ in range(3):
        parallel_apply(modules[:2], [torch.randn(2, 4)] * 2, devices=["cpu", "cpu"])
    assert _pool_threads() == threads


def test_replica_zero_on_the_caller_sees_the_same_context_as_the_workers() -> None:
    # Replica 0 runs inline: grad mode and autocast are replayed there as on a worker, and an
    # error in it still waits for the other replicas and names replica 0.
    modules = [Recorder() for _ in range(3)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply(modules, [torch.randn(2, 4)] * 3, devices=CPU3)
    assert [o["grad"] for o in outs] == [False] * 3
    assert [o["autocast"] for o in outs] == [True] * 3
    assert {o["autocast_dtype"] for o in outs} == {torch.bfloat16}
    finished: list[int] = []

    class Slow(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.i == 0:
                raise KeyError("boom")
            time.sleep(0.05)
            finished.append(self.i)
            return x

    with pytest.raises(KeyError, match="replica 0 on cpu"):
        parallel_apply([Slow(i) for i in range(3)], [torch.ones(1)] * 3, devices=CPU3)
    assert sorted(finished) == [1, 2]  # the others ran to the end before the error came back


def test_single_module_runs_inline() -> None:
    (out,) = parallel_apply([Recorder()], [torch.randn(2, 4)], devices=["cpu"])
    assert out["thread"] == threading.current_thread().name


def test_a_tuple_or_a_list_is_unpacked_as_in_torch() -> None:
    """torch's convention (issue 39): a tuple or a list is the replica's arguments; a list
    inside the tuple stays one argument."""
    modules = [Recorder() for _ in range(3)]
    x = torch.randn(2, 4)
    inputs = [(x, [1, 2]), [x, x], x]
    outs = parallel_apply(modules, inputs, devices=CPU3)
    assert [o["nargs"] for o in outs] == [2, 2, 1]
    assert [o["arg_types"] for o in outs] == [["Tensor", "list"], ["Tensor", "Tensor"], ["Tensor"]]


def test_kwargs_reach_each_replica() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, *, factor: float, bias: torch.Tensor) -> torch.Tensor:
            return x * factor + bias

    x = [torch.randn(3, 2) for _ in range(2)]
    kwargs = [{"factor": 2.0, "bias": torch.ones(2)}, {"factor": -1.0, "bias": torch.zeros(2)}]
    outs = parallel_apply([Scale(), Scale()], [(xi,) for xi in x], kwargs, ["cpu", "cpu"])
    for o, xi, kw in zip(outs, x, kwargs, strict=True):
        torch.testing.assert_close(o, xi * kw["factor"] + kw["bias"])


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode_is_replayed(grad: bool) -> None:
    modules = [Recorder() for _ in range(3)]
    with torch.set_grad_enabled(grad):
        outs = parallel_apply(modules, [torch.randn(2, 4)] * 3, devices=CPU3)
    assert all(o["grad"] is grad for o in outs)
    assert all((o["out"].grad_fn is not None) is grad for o in outs)


def test_cpu_autocast_is_replayed() -> None:
    modules = [Recorder() for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply(modules, [torch.randn(2, 4)] * 2, devices=["cpu", "cpu"])
    assert all(o["autocast"] and o["autocast_dtype"] == torch.bfloat16 for o in outs)
    assert all(o["out"].dtype == torch.bfloat16 for o in outs)
    plain = parallel_apply(modules, [torch.randn(2, 4)] * 2, devices=["cpu", "cpu"])
    assert not any(o["autocast"] for o in plain)
    assert all(o["out"].dtype == torch.float32 for o in plain)


def test_timings_are_filled() -> None:
    class Sleepy(nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(self.seconds)
            return x

    timings = [99.0] * 5  # replaced, not appended to
    modules = [Sleepy(0.0), Sleepy(0.05)]
    parallel_apply(modules, [torch.ones(1)] * 2, None, ["cpu"] * 2, timings=timings)
    assert len(timings) == 2
    assert timings[1] >= 0.05 and timings[0] < timings[1]


def test_gradients_flow_through_replicate_and_the_pool() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(9, 4)
    outs = parallel_apply(replicate(model, CPU3), list(x.chunk(3)), devices=CPU3)
    torch.cat(outs).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)


class Failing(nn.Module):
    def __init__(self, error: BaseException | None = None, delay: float = 0.0) -> None:
        super().__init__()
        self.error = error
        self.delay = delay
        self.finished = False

    def forward(self, *args: Any) -> int:
        time.sleep(self.delay)
        self.finished = True
        if self.error is not None:
            raise self.error
        return len(args)


class TwoArgError(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def test_error_keeps_type_names_replica_and_chains_the_original() -> None:
    original = ValueError("bad chunk")
    slow = Failing(delay=0.1)
    modules = [Failing(), Failing(original), slow]
    inputs = [(torch.ones(5, 3),), (torch.ones(5, 3), [1, 2]), (torch.ones(1),)]
    with pytest.raises(ValueError) as info:
        parallel_apply(modules, inputs, devices=CPU3)
    message = str(info.value)
    assert message.startswith("replica 1 on cpu, inputs (Tensor[5, 3], list[2]): bad chunk")
    assert info.value.__cause__ is original
    assert original.__traceback__ is not None  # the replica's frames are kept
    assert slow.finished  # every replica finished before the error was raised


def test_error_type_that_needs_two_arguments_becomes_runtime_error() -> None:
    original = TwoArgError(7, "nope")
    with pytest.raises(RuntimeError, match=r"TwoArgError: replica 0 on cpu.*7: nope") as info:
        parallel_apply([Failing(original), Failing()], [torch.ones(2)] * 2, devices=["cpu"] * 2)
    assert info.value.__cause__ is original


def test_several_failures_are_counted() -> None:
    modules = [Failing(KeyError("a")), Failing(), Failing(KeyError("b"))]
    with pytest.raises(KeyError, match=r"replica 0 .*replicas \[2\] failed too"):
        parallel_apply(modules, [torch.ones(1)] * 3, devices=CPU3)


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=repr)
def test_pool_survives_errors(error: BaseException) -> None:
    parallel_apply([Failing(), Failing(), Failing()], [torch.ones(1)] * 3, devices=CPU3)
    threads = _pool_threads()
    with pytest.raises(type(error)):
        parallel_apply([Failing(), Failing(error), Failing()], [torch.ones(1)] * 3, devices=CPU3)
    outs = parallel_apply([Failing(), Failing(), Failing()], [(1, 2)] * 3, devices=CPU3)
    assert outs == [2, 2, 2]
    assert _pool_threads() == threads


def test_caller_interrupted_while_waiting_leaves_the_pool_usable() -> None:
    class Interrupter(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # A real SIGINT to the main thread, which is blocked waiting for this replica.
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            time.sleep(0.2)
            return x

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    parallel_apply([Failing(), Failing()], [torch.ones(1)] * 2, devices=["cpu"] * 2)
    threads = _pool_threads()
    with pytest.raises(KeyboardInterrupt):
        parallel_apply([Failing(), Interrupter()], [torch.ones(1)] * 2, devices=["cpu"] * 2)
    outs = parallel_apply([Failing(), Failing()], [(1,), (1, 2)], devices=["cpu"] * 2)
    assert outs == [1, 2]
    assert _pool_threads() == threads


def test_an_interrupted_caller_waits_for_the_running_replica() -> None:
    class Interrupter(nn.Module):
        finished = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.1)  # the caller is past replica 0, waiting for this one
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            time.sleep(0.3)  # the caller has its KeyboardInterrupt meanwhile
            Interrupter.finished = True
            return x

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    with pytest.raises(KeyboardInterrupt):
        parallel_apply([Failing(), Interrupter()], [torch.ones(1)] * 2, devices=["cpu"] * 2)
    # The interrupt reached the caller only once the worker's chunk was done: a program that
    # ends on it never leaves a worker inside a torch operator at exit.
    assert Interrupter.finished


SLOW_WORKER = """
import os, signal, sys, threading, time, torch, dataparallel as dp

class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.1)  # the caller is past replica 0, waiting for this one
            os.kill(os.getpid(), signal.SIGINT)
            a = torch.randn(1000, 1000)
            for _ in range(20):
                a = a @ a / 1000  # inside torch's C++ code, the GIL released
        return self.lin(x)

try:
    dp.DataParallel(Slow(), ["cpu", "cpu"])(torch.randn(8, 4))
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.timeout(120)
def test_a_program_ending_on_ctrl_c_exits_with_its_own_status() -> None:
    # Before, the interpreter exited while the worker was inside a matmul: SIGABRT (-6),
    # "terminate called without an active exception".
    done = subprocess.run(
        [sys.executable, "-c", SLOW_WORKER], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 130, done.stderr[-2000:]


@pytest.mark.timeout(30)
def test_nested_call_from_a_worker_completes() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            parts = parallel_apply([self.inner, self.inner], list(x.chunk(2)), devices=CPU3[:2])
            return torch.cat(parts)

    torch.manual_seed(0)
    outer = Outer()
    x = [torch.randn(4, 4) for _ in range(3)]
    outs = parallel_apply([outer, outer, outer], x, devices=CPU3)
    for o, xi in zip(outs, x, strict=True):
        torch.testing.assert_close(o, outer.inner(xi))


def test_devices_are_inferred_from_inputs() -> None:
    outs = parallel_apply([Recorder(), Recorder()], [torch.randn(2, 4)] * 2)
    assert all(o["out"].shape == (2, 3) for o in outs)


def test_describe_inputs() -> None:
    import numpy as np

    text = describe_inputs((torch.zeros(2, 3), np.zeros(4), {"a": 1}, "s", None), {"k": [1]})
    assert text == "(Tensor[2, 3], ndarray[4], dict[1], str, NoneType, k=list[1])"


def test_length_mismatches_are_reported() -> None:
    m = Recorder()
    with pytest.raises(ValueError, match=r"inputs: expected one entry per module \(2\), got 1"):
        parallel_apply([m, m], [torch.ones(1, 4)])
    with pytest.raises(ValueError, match=r"kwargs_tup: expected one mapping per module"):
        parallel_apply([m, m], [torch.ones(1, 4)] * 2, [{}])
    with pytest.raises(ValueError, match=r"devices: expected one device per module"):
        parallel_apply([m, m], [torch.ones(1, 4)] * 2, None, ["cpu"])
    assert parallel_apply([], []) == []


# -- CUDA ---------------------------------------------------------------------------------------


def _cuda_lists() -> list[list[int]]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return [[0], [0, 0], list(range(count))]


@pytest.mark.cuda
@pytest.mark.parametrize("devices", _cuda_lists(), ids=str)
def test_cuda_parallel_apply_matches_one_device(devices: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).cuda(0)
    reference = copy.deepcopy(model)
    x = torch.randn(8 * len(devices), 4, device="cuda:0")
    chunks = [c.to(f"cuda:{d}") for c, d in zip(x.chunk(len(devices)), devices, strict=True)]
    timings: list[float] = []
    outs = parallel_apply(replicate(model, devices), chunks, devices=devices, timings=timings)
    assert [o.device for o in outs] == [torch.device("cuda", d) for d in devices]
    assert len(timings) == len(devices)
    torch.cat([o.to("cuda:0") for o in outs]).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
    with torch.autocast("cuda", dtype=torch.float16):
        half = parallel_apply(replicate(model, devices), chunks, devices=devices)
    assert all(o.dtype == torch.float16 for o in half)
