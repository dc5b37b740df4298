"""Forward writes seen by mechanism, on every call (issue 60, items 1-4).

An EMA teacher whose first update changes no value, a teacher made after the first call, a
write that keeps the sum and norm, and a trainable weight written in forward: each against the
same module on one device, call after call, on CPU lists whose replicas share the parameters.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

SHARED = [["cpu", "cpu"], ["cpu"] * 3]


class Ema(nn.Module):
    """A student and its EMA teacher (``copy.deepcopy(student)``, BYOL / mean teacher), the
    teacher updated inside forward by ``style``: through ``.data``, by ``_foreach_lerp_``
    (timm's ``ModelEmaV2``), or by a row rotation (a write that keeps the sum and norm)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Linear(4, 4)
        self.teacher = copy.deepcopy(self.student)
        for p in self.teacher.parameters():
            p.requires_grad = False
        self.style = style

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            t, s = list(self.teacher.parameters()), list(self.student.parameters())
            if self.style == "data":
                for pt, ps in zip(t, s, strict=True):
                    pt.data.mul_(0.5).add_(ps.data, alpha=0.5)
            elif self.style == "foreach":
                torch._foreach_lerp_(t, s, 0.5)
            else:
                self.teacher.weight.data.copy_(self.teacher.weight.data.roll(1, 0))
        return self.student(x), self.teacher(x)


def _step(model: nn.Module, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    model.student.weight.grad = None
    model.student.bias.grad = None
    (out[0].square().mean() + out[1].mean()).backward()
    with torch.no_grad():
        for p in model.student.parameters():
            p -= 0.5 * p.grad


@pytest.mark.parametrize("devices", SHARED, ids=str)
@pytest.mark.parametrize("style", ["data", "foreach", "rotate"])
def test_an_ema_teacher_written_from_its_first_call_is_written_once_per_call(
    devices: list[str], style: str
) -> None:
    ref = Ema(style)
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(6, 4, generator=gen)
        got, want = wrapper(x), ref(x)
        # before: the teacher's output off at call 1, its weight off by 0.0133 after 4 calls
        assert_close_rel(got[1], want[1], msg=f"teacher output, call {step}")
        assert_close_rel(par.teacher.weight, ref.teacher.weight, msg=f"teacher, call {step}")
        _step(ref, want)
        _step(par, got)


class Momentum(nn.Module):
    """MoCo's pair, the key encoder re-made from the query encoder by ``remake()``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(4, 4)
        self.remake()

    def remake(self) -> None:
        self.k = copy.deepcopy(self.q)
        for p in self.k.parameters():
            p.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters(), strict=True):
                pk.data.mul_(0.5).add_(pq.data, alpha=0.5)
                pk.data.add_(1.0)
        return self.q(x) + self.k(x)


@pytest.mark.parametrize("devices", SHARED, ids=str)
def test_a_teacher_made_after_the_first_call_is_written_once_per_call(
    devices: list[str],
) -> None:
    ref = Momentum()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 2:  # ``self.k = copy.deepcopy(self.q)`` after the first calls
            ref.remake()
            par.remake()
        x = torch.randn(6, 4, generator=gen)
        assert_close_rel(wrapper(x), ref(x), msg=f"output, call {step}")
        # before: the key weight off by 0.546 after 5 calls
        assert_close_rel(par.k.weight, ref.k.weight, msg=f"k.weight, call {step}")


class Renorm(nn.Module):
    """A trainable weight renormalised in forward under ``no_grad`` (a max-norm
    constraint), or by a ``.data =`` assignment."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.style = style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.style == "in-place":
                self.lin.weight.mul_(0.9)
            else:
                self.lin.weight.data = self.lin.weight.data * 0.9
        return self.lin(x)


@pytest.mark.parametrize("style", ["in-place", "assign"])
def test_a_trainable_weight_written_in_forward_is_refused_at_the_call(style: str) -> None:
    wrapper = dp.DataParallel(Renorm(style), ["cpu", "cpu"])
    # before: written twice per call, silently (or raced under contention)
    with pytest.raises(RuntimeError, match=r"'lin\.weight'.*outside the wrapped call"):
        wrapper(torch.randn(4, 4))


class _Switched(nn.Module):
    """A linear layer and a buffer (its replicas then get private buffer copies on every call),
    whose forward renormalises the trainable weight in place once ``write`` is set."""

    write = False

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Switched.write:
            with torch.no_grad():
                self.lin.weight.mul_(0.9)
        return self.lin(x) * self.scale


@pytest.mark.parametrize("grad", [True, False])
def test_a_trainable_weight_written_at_a_warm_call_of_a_module_with_buffers_is_refused(
    grad: bool,
) -> None:
    """A module with buffers refreshes its replicas' tensors on every call: the guard of the
    trainable parameters the replicas share is taken there too, from the first call on."""
    model = _Switched()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    x = torch.randn(4, 4)
    _Switched.write = False
    try:
        with torch.set_grad_enabled(grad):
            for _ in range(3):
                assert_close_rel(wrapper(x), oracle(x))
            _Switched.write = True
            with pytest.raises(RuntimeError, match=r"'lin\.weight'.*outside the wrapped call"):
                wrapper(x)
    finally:
        _Switched.write = False


def test_a_trainable_weight_written_on_separate_devices_is_not_refused() -> None:
    ref = Renorm("in-place")
    par = copy.deepcopy(ref)
    x = torch.randn(4, 4)
    out = dp.DataParallel(par, ["cpu", "cpu:1"])(x)
    assert_close_rel(out, ref(x))
    assert_close_rel(par.lin.weight, ref.lin.weight)


def test_a_frozen_backbone_is_not_copied_for_the_replicas() -> None:
    """Item 4: the replicas after the first hold copy-on-write clones of a frozen parameter
    that forward does not write, which share the module's memory (before: a full copy per
    extra replica at the first call in each mode)."""
    backbone = nn.Linear(64, 64).requires_grad_(False)
    model = nn.Sequential(backbone, nn.Linear(64, 2))
    replicas = dp.replicate(model, ["cpu", "cpu", "cpu"])
    for _ in range(2):
        for rep in replicas[1:]:
            weight = rep[0].weight
            assert weight is not backbone.weight
            assert weight.const_data_ptr() == backbone.weight.const_data_ptr()
        replicas = dp.replicate(model, ["cpu", "cpu", "cpu"])


class Counted(nn.Module):
    """A frozen counter parameter written in forward, and used in the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.count = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.count.add_(1)
        return self.lin(x) * self.count


NOT_THE_MODULE = [  # replica 0 is a copy: another slot, or no chunk for the module's device
    (["cpu:1", "cpu:1"], None),
    (["cpu:1"] * 3, None),
    (["cpu", "cpu:1", "cpu:1"], [0, 3, 3]),
]


@pytest.mark.parametrize(("devices", "sizes"), NOT_THE_MODULE, ids=str)
@pytest.mark.parametrize("model", ["ema", "counted"])
def test_a_frozen_parameter_written_by_a_replica_0_that_is_a_copy_lands_on_the_module(
    devices: list[str], sizes: list[int] | None, model: str
) -> None:
    """Replica 0's write of a frozen parameter is the module's, as its buffers' are
    (``copy_writes_back``); before, it was dropped: the counter stayed at 0, and the outputs
    were off from call 1 (found by the forward-writes probe of stop 74)."""
    ref: nn.Module = Ema("rotate") if model == "ema" else Counted()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices, chunk_sizes=sizes)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(6, 4, generator=gen)
        with torch.no_grad():
            got, want = wrapper(x), ref(x)
        pairs = zip(*((o,) if isinstance(o, torch.Tensor) else o for o in (got, want)), strict=True)
        for g, w in pairs:
            assert_close_rel(g, w, msg=f"output, call {step}")
        for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            assert_close_rel(p, q, msg=f"{name}, call {step}")


class Flagged(nn.Module):
    """A frozen counter written only for a chunk that holds a flagged sample (its first
    feature over 5): the write depends on the chunk, so only the replica holding that sample
    makes it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.seen = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flagged = x[:, 0] > 5
        if flagged.any():
            with torch.no_grad():
                self.seen.add_(x[flagged].sum(0))
        return self.lin(x) * self.seen  # (a factor: replica 0's graph saves the parameter)


# Shared (copy-on-write clones), and copies on other devices (replica 0 the module, or a copy)
WRITERS = [*SHARED, ["cpu", "cpu:1"], ["cpu:1", "cpu:1"], ["cpu:1", "cpu:2"]]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("devices", WRITERS, ids=str)
def test_a_frozen_parameter_written_by_a_later_replica_only_lands_and_is_said(
    devices: list[str], grad: bool
) -> None:
    """Before, the last replica's write went to its own clone (or copy) and was dropped:
    ``seen`` stayed at one, off by 10, 20, 30 after three calls, with no word. Now its write
    lands on the module, once per call, and the first call says that the replicas before it
    computed with the value from before the write (which one device's would not have).
    Backward runs: replica 0's graph saved the parameter, and an in-place copy onto it would
    have made that backward raise."""
    model = Flagged()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    for call in range(3):
        x = torch.randn(6, 4)
        x[5, 0] = 10.0  # the last sample: the last replica's chunk
        with warnings.catch_warnings(record=True) as said, torch.set_grad_enabled(grad):
            warnings.simplefilter("always")
            out = wrapper(x)
        want = oracle(x)
        if grad:
            out.sum().backward()
        assert_close_rel(model.seen, oracle.seen, msg=f"call {call}: the counter")
        last = x.shape[0] - wrapper.last_call.chunk_sizes[-1]
        assert_close_rel(out[last:], want[last:], msg=f"call {call}: the writer's rows")
        messages = [str(w.message) for w in said]
        if call == 0:
            assert len(messages) == 1, messages
            assert (
                f"parameter 'seen' (it does not require grad) in replica {len(devices) - 1}"
                in (messages[0])
            )
        else:
            assert messages == [], messages  # said once


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("devices", WRITERS, ids=str)
def test_a_frozen_parameter_written_by_replica_0_only_is_said(
    devices: list[str], grad: bool
) -> None:
    """The mirror of the test above: the flagged sample in replica 0's chunk. Its write is the
    module's, once per call, but every other replica computed its chunk with the value from
    before it, where one device computes every row after the write. Before: no word (stop
    76's probe: the output off by 0.53 on every list); now said once, as a later replica's."""
    model = Flagged()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    for call in range(3):
        x = torch.randn(6, 4)
        x[0, 0] = 10.0  # the first sample: replica 0's chunk
        with warnings.catch_warnings(record=True) as said, torch.set_grad_enabled(grad):
            warnings.simplefilter("always")
            out = wrapper(x)
        want = oracle(x)
        if grad:
            out.sum().backward()
        assert_close_rel(model.seen, oracle.seen, msg=f"call {call}: the counter")
        first = wrapper.last_call.chunk_sizes[0]
        assert_close_rel(out[:first], want[:first], msg=f"call {call}: the writer's rows")
        messages = [str(w.message) for w in said]
        if call == 0:
            assert len(messages) == 1, messages
            assert "in replica 0 (its chunk) and in no other replica" in messages[0]
        else:
            assert messages == [], messages  # said once


class RunningStat(nn.Module):
    """A frozen running mean every replica writes through ``.data`` in place, from its own
    chunk: as BatchNorm's statistics, the module keeps replica 0's (its chunk's) write."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.u = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.u.data.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.lin(x) + self.u


@pytest.mark.parametrize("devices", [*WRITERS, ["cpu", "cpu:1", "cpu:1"]], ids=str)
def test_a_frozen_parameter_every_replica_writes_through_data_keeps_replica_0s_write(
    devices: list[str],
) -> None:
    """Found by stop 75's probe: on ``["cpu", "cpu:1", "cpu:1"]`` replica 0's write through
    ``.data`` to the module's parameter shows nowhere, while replica 1's to its copy (the
    source of replica 2's clone) clears a copy-on-write flag: replica 1's write was copied
    over replica 0's, with a warning that replica 0 had not written (off by 0.8 after one
    call). The module keeps replica 0's write, with no word, on every list."""
    model = RunningStat()
    oracle = copy.deepcopy(model)  # replica 0's chunk alone, as BatchNorm's rule
    wrapper = dp.DataParallel(model, devices)
    x = torch.arange(24.0).reshape(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            wrapper(x)
    oracle(x[: wrapper.last_call.chunk_sizes[0]])
    assert_close_rel(model.u, oracle.u, msg="the running mean")


# -- every replica writes a frozen parameter at once ------------------------------------------


class Gated(nn.Module):
    """An EMA teacher every replica writes (``_foreach_lerp_``), each replica's tensor's data
    address read before and after its write; ``gate``, where given, makes them write at once
    (``test_writes_at_once`` runs the same module in a process of its own)."""

    def __init__(self, gate: threading.Barrier | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Linear(8, 8)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.gate = [gate]  # (a list: a barrier is no attribute the replicas rebind)
        self.addresses: list[tuple[int, int]] = []  # (before the write, after it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate[0] is not None:
            self.gate[0].wait()
        before = self.teacher.weight.const_data_ptr()
        with torch.no_grad():
            teacher = list(self.teacher.parameters())
            torch._foreach_lerp_(teacher, list(self.student.parameters()), 0.5)
        self.addresses.append((before, self.teacher.weight.const_data_ptr()))
        return self.student(x) + self.teacher(x)


@pytest.mark.filterwarnings("ignore:module. forward wrote the attribute 'addresses'")
@pytest.mark.parametrize("devices", [*SHARED, ["cpu:1", "cpu:1"]], ids=str)
def test_no_replica_write_takes_over_memory_another_replica_may_still_be_copying(
    devices: list[str],
) -> None:
    """Replicas that share a frozen parameter's memory (copy-on-write clones) and all write it
    in the same call each write a copy of their own: none takes the shared memory over. torch
    hands the last writer of a copy-on-write memory the memory itself, unguarded against a
    writer in another thread still copying it, which corrupts the heap: "free(): unaligned
    chunk", in 3 runs of 45 of this file with test_shared_writes_said.py, at stop 75. Before:
    the last writer's tensor kept the shared address, on every call."""
    ref = Gated()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2 * len(devices), 8, generator=gen)
        par.addresses.clear()
        assert_close_rel(wrapper(x), ref(x), msg=f"call {step}")
        assert_close_rel(par.teacher.weight, ref.teacher.weight, msg=f"teacher, call {step}")
        before, after = zip(*par.addresses, strict=True)
        assert len(after) == len(devices) and len(set(before)) == 1, par.addresses
        assert before[0] not in after, f"call {step}: a writer took the shared memory over"
