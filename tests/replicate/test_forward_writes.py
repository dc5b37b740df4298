"""Parameters written inside forward (issue 49, item 3): momentum encoders and EMA teachers.

MoCo's key encoder is updated inside forward by assignment (``param_k.data = param_k.data * m
+ param_q.data * (1 - m)``), BYOL-style code in place (``param_k.data.mul_(m).add_(...)``).
Where the replicas share the module's parameters, every replica wrote the same tensor: the
number of updates per call was a race (``[1, 2, 2, 1, 1, 1]`` over six calls on 2 replicas),
and the outputs used whatever had been written so far. Each case here is the same module on
one device, call after call, on every CPU list: one update per call, the same outputs, the
same gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"], ["cpu"] * 3]


class Momentum(nn.Module):
    """A query encoder trained by backprop and a key encoder that follows it by momentum,
    updated inside forward (``style``: MoCo's assignment, or in place), with a counter of
    updates written by forward too, and a queue of negatives (a buffer, read). MoCo's enqueue
    of the batch's keys is left out: a buffer written in forward keeps replica 0's write, as
    BatchNorm's statistics do under torch's DataParallel (the guide's rule)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(4, 4)
        self.k = nn.Linear(4, 4)
        for p in self.k.parameters():
            p.requires_grad = False
        self.updates = nn.Parameter(torch.zeros(()), requires_grad=False)
        self.register_buffer("queue", torch.randn(8, 4))
        self.style = style

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters(), strict=True):
                if self.style == "assign":
                    pk.data = pk.data * 0.9 + pq.data * 0.1
                else:
                    pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
            self.updates.data += 1
        q, k = self.q(x), self.k(x)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.t()], dim=1)
        return logits, k


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("style", ["assign", "in-place"])
def test_a_momentum_update_lands_once_per_call(devices: list[str], style: str) -> None:
    ref = Momentum(style)
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices)
    opt_ref = torch.optim.SGD(ref.q.parameters(), lr=0.1)
    opt_par = torch.optim.SGD(par.q.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(7, 4, generator=gen)
        if step == 4:  # a mode the set has not seen: watched again
            ref.eval()
            par.eval()
        logits, k = wrapper(x)
        want, want_k = ref(x)
        assert_close_rel(logits, want, msg=f"logits, call {step}")
        assert_close_rel(k, want_k, msg=f"keys, call {step}")
        assert int(par.updates) == step + 1  # before: [1, 2, 2, 1, 1, 1] on two replicas
        assert_close_rel(par.k.weight, ref.k.weight, msg=f"k.weight after call {step}")
        if ref.training:
            for opt, out in ((opt_ref, want), (opt_par, logits)):
                opt.zero_grad()
                out.logsumexp(1).mean().backward()
                opt.step()
            assert_close_rel(par.q.weight, ref.q.weight, msg=f"q.weight after call {step}")


def test_parameters_forward_does_not_write_stay_shared() -> None:
    """Only what forward writes is copied: after the watched call, replica 1 computes with
    the module's own query weights (no copy), and a copy of the written key weights."""
    model = Momentum("in-place")
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    seen: list[tuple[bool, bool]] = []
    # ids read here: inside forward, a closure over the module is rebound to each replica
    ids = (id(model.q.weight), id(model.k.weight))

    def spy(mod: nn.Module, args: object, out: object) -> None:
        seen.append((id(mod.weight) == ids[0], id(mod.weight) == ids[1]))

    x = torch.randn(4, 4)
    wrapper(x)  # the watched call: every shared parameter copied
    handles = [model.q.register_forward_hook(spy), model.k.register_forward_hook(spy)]
    try:
        wrapper(x)
    finally:
        for h in handles:
            h.remove()
    assert sorted(seen) == sorted([(True, False), (False, True), (True, False), (False, False)])


class Unwritten(nn.Module):
    """A plain network: nothing written in forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_plain_network_still_trains_exactly_through_the_watched_call() -> None:
    """The watched call leaves parameters trained by backprop shared (only those without grad
    are copied and watched): gradients are one device's, and no copy is made."""
    ref = Unwritten()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, ["cpu", "cpu", "cpu"])
    x = torch.randn(5, 4)
    seen: list[bool] = []
    ident = id(par.lin.weight)  # (read here: inside forward, closures are rebound)
    par.lin.register_forward_hook(lambda m, a, o: seen.append(id(m.weight) == ident))
    for _ in range(2):  # the watched call, then a plain one
        for m in (ref, par):
            m.zero_grad()
        ref(x).pow(2).sum().backward()
        wrapper(x).pow(2).sum().backward()
        for p, q in zip(par.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert_close_rel(p.grad, q.grad)
    assert seen == [True] * 6  # every replica computed with the module's own weight


class Counter(nn.Module):
    """An integer parameter (no grad) counted up in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = nn.Parameter(torch.zeros((), dtype=torch.long), requires_grad=False)
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.data += 1
        return self.lin(x) * self.steps


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_an_integer_parameter_counted_in_forward_counts_calls(devices: list[str]) -> None:
    model = Counter()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(5, 2)
    for call in range(1, 5):
        out = wrapper(x)
        assert int(model.steps) == call
        assert_close_rel(out, model.lin(x) * call)
