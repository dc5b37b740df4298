"""Parameters of the tree held in a holder made in ``__init__`` (issue 60, M1).

An EMA teacher updated in forward through a list of its parameters kept on the module
(``self.ema = list(teacher.parameters())``), a tuple of (student, teacher) pairs, a dict by
name, an object of the user's own, a hook's closure or a ``functools.partial``: each replica
must write and read its own tensors there, as it does through ``self.teacher.weight``. Before,
every replica wrote the module's own tensors (the EMA made once per replica per call, with no
word: the teacher off by 0.054 after 3 calls on every list), and on two GPUs would have read
them across devices. Each case against the same module on one device, call after call, with
the student trained between calls.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp
from _close import assert_close_rel

DEVICES = [["cpu", "cpu"], ["cpu"] * 3, ["cpu", "cpu:1"], ["cpu:1", "cpu:1"]]


@dataclass
class EmaState:
    """An object of the user's own that holds the parameters to average."""

    teacher: list[nn.Parameter]
    student: list[nn.Parameter]


def _update(teacher: list[Any], student: list[Any], style: str) -> None:
    with torch.no_grad():
        if style == "foreach":
            torch._foreach_lerp_(teacher, student, 0.5)
        elif style == "data":
            for t, s in zip(teacher, student, strict=True):
                t.data.mul_(0.5).add_(s.data, alpha=0.5)
        else:
            for t, s in zip(teacher, student, strict=True):
                t.copy_(t * 0.5 + s * 0.5)


def _pre_hook(
    params: tuple[list[Any], list[Any]], style: str, module: nn.Module, args: Any
) -> None:
    _update(*params, style)


class HeldEma(nn.Module):
    """A student and its EMA teacher, the teacher updated in forward through ``holder``."""

    def __init__(self, holder: str, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Linear(4, 4)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.holder, self.style = holder, style
        t, s = list(self.teacher.parameters()), list(self.student.parameters())
        if holder == "list":
            self.held: Any = [*t, *s]
        elif holder == "pairs":
            self.held = tuple(zip(t, s, strict=True))
        elif holder == "dict":
            self.held = {"teacher": t, "student": s}
        elif holder == "object":
            self.held = EmaState(t, s)
        elif holder == "keyed":  # the tree's tensors as keys: each teacher's student
            self.held = dict(zip(t, s, strict=True))
        elif holder == "closure":

            def hook(module: nn.Module, args: Any) -> None:
                _update(t, s, style)

            self.register_forward_pre_hook(hook)
        else:  # a partial
            self.register_forward_pre_hook(functools.partial(_pre_hook, (t, s), style))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.__dict__.get("held")
        if self.holder == "list":
            _update(held[:2], held[2:], self.style)
        elif self.holder == "pairs":
            _update([t for t, _ in held], [s for _, s in held], self.style)
        elif self.holder == "dict":
            _update(held["teacher"], held["student"], self.style)
        elif self.holder == "object":
            _update(held.teacher, held.student, self.style)
        elif self.holder == "keyed":
            _update(list(held), list(held.values()), self.style)
        return self.student(x), self.teacher(x)


def _step(model: nn.Module, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    (out[0].square().mean() + out[1].mean()).backward()
    with torch.no_grad():
        for p in model.student.parameters():
            p -= 0.5 * p.grad
            p.grad = None


HOLDERS = ["list", "pairs", "dict", "object", "closure", "partial", "keyed"]
STYLES = ["foreach", "data", "copy"]


@pytest.mark.parametrize("devices", DEVICES, ids=str)
@pytest.mark.parametrize("holder", HOLDERS)
def test_a_teacher_written_through_a_holder_made_in_init_is_written_once_per_call(
    holder: str, devices: list[str]
) -> None:
    style = STYLES[HOLDERS.index(holder) % len(STYLES)]
    ref = HeldEma(holder, style)
    par = HeldEma(holder, style)  # (made anew: a deepcopy shares a closure's cells)
    wrapper = dp.DataParallel(par, devices)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(6, 4, generator=gen)
        got, want = wrapper(x), ref(x)
        assert_close_rel(got[1], want[1], msg=f"teacher output, call {step}")
        assert_close_rel(par.teacher.weight, ref.teacher.weight, msg=f"teacher, call {step}")
        _step(ref, want)
        _step(par, got)
    assert_close_rel(par.student.weight, ref.student.weight, msg="student after 3 steps")


class Tied(nn.Module):
    """An output layer that reads the embedding's weight through a list made in ``__init__``
    (weight tying kept by hand)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.tied = [self.emb.weight]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.emb(ids).tanh(), self.tied[0])


@pytest.mark.parametrize("devices", [["cpu", "cpu:1"], ["cpu:1", "cpu:2"], ["cpu", "cpu"]], ids=str)
def test_a_trainable_parameter_read_through_a_holder_is_each_replicas_own(
    devices: list[str],
) -> None:
    """Each replica's holder holds that replica's tensor (on two GPUs, the one on its own
    device; before: the module's, on the first), and the gradient is one device's."""
    ref = Tied()
    par = copy.deepcopy(ref)
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    for replica in dp.replicate(par, devices)[1:]:
        assert replica.tied[0] is replica.emb.weight
    out, want = dp.DataParallel(par, devices)(ids), ref(ids)
    assert_close_rel(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    assert_close_rel(par.emb.weight.grad, ref.emb.weight.grad)


class Keyed(nn.Module):
    """A scale per parameter, looked up in forward by the parameter itself (a mask or a
    learning-rate factor kept as ``{param: value}``, as pruning and optimizer-like code keeps)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scales = {self.lin.weight: 2.0, self.lin.bias: 0.5}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.lin.weight, self.lin.bias
        return F.linear(x, w * self.scales[w], b * self.scales[b])


@pytest.mark.parametrize("devices", [["cpu", "cpu:1"], ["cpu:1", "cpu:2"], ["cpu", "cpu"]], ids=str)
def test_a_dict_keyed_by_the_trees_parameters_is_each_replicas_own(devices: list[str]) -> None:
    """Before, the keys stayed the module's tensors: a replica whose parameters are copies
    (another device) raised ``KeyError`` looking its own weight up."""
    ref = Keyed()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices)
    x = torch.randn(6, 4)
    for grad in (True, False, True):
        with torch.set_grad_enabled(grad):
            out, want = wrapper(x), ref(x)
        assert_close_rel(out, want, msg=f"grad {grad}")
    out.square().sum().backward()
    want.square().sum().backward()
    assert_close_rel(par.lin.weight.grad, ref.lin.weight.grad)


class HeldStats(nn.Module):
    """An EMA teacher whose BatchNorm statistics forward averages from the student's, through
    lists of both made in ``__init__`` (a mean teacher that keeps its buffers in step)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False).eval()
        self.student[1].running_mean.uniform_(-1.0, 1.0)  # (statistics the teacher moves to)
        self.student[1].running_var.uniform_(0.5, 2.0)
        floats = [b for b in self.teacher.buffers() if b.is_floating_point()]
        self.held = (floats, [b for b in self.student.buffers() if b.is_floating_point()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            torch._foreach_lerp_(self.held[0], self.held[1], 0.5)
        return self.student(x) + self.teacher(x)


@pytest.mark.parametrize("devices", DEVICES, ids=str)
def test_a_teacher_buffer_written_through_a_holder_is_written_once_per_call(
    devices: list[str],
) -> None:
    """Buffers too: replica 0 writes the module's, every other replica its own copy (before:
    every replica wrote the module's, the average taken once per replica per call)."""
    ref, par = HeldStats(), HeldStats()
    wrapper = dp.DataParallel(par, devices)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(6, 4, generator=gen)
        with torch.no_grad():  # (the student's statistics are replica 0's chunk's: not compared)
            ref.student.eval(), par.student.eval()
            assert_close_rel(wrapper(x), ref(x), msg=f"output, call {step}")
        for (name, b), c in zip(par.teacher.named_buffers(), ref.teacher.buffers(), strict=True):
            assert_close_rel(b, c, msg=f"teacher buffer {name}, call {step}")


class WithOptimizer(nn.Module):
    """A model that keeps its own optimizer (as RL code does), not used in forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
        self.opt = torch.optim.Adam(self.parameters(), lr=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu:1"]], ids=str)
def test_a_library_object_that_holds_the_parameters_is_shared_not_rebuilt(
    devices: list[str],
) -> None:
    """An optimizer's parameter groups are its own state: the replicas share the optimizer
    itself (before, on the first version of this stop's change, each replica got a copy
    rebuilt at every call where its tensors were new: 2x the call on a 100-layer model)."""
    model = WithOptimizer()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(6, 4)
    for _ in range(2):
        wrapper(x).sum().backward()
        model.opt.step()
        model.opt.zero_grad()
    for replica in dp.replicate(model, devices)[1:]:
        assert replica.opt is model.opt
