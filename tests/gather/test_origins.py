"""``dataparallel.gather._origins``: a scalar every replica received (a buffer, a parameter, a
broadcast input) comes back as one value, not summed per replica, while a value each replica
computed from its chunk is still a count (issue 29, item 7). The oracle is the module run plainly
on one device; ``cpu:1`` lists give each replica its own copy, so identity alone cannot tell."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
IDS = ["shared", "copied", "mixed"]


class Step(nn.Module):
    """Returns its output, a 0-dim integer buffer as is, and one it replaces each call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)
        self.register_buffer("step", torch.tensor(5))
        self.register_buffer("calls", torch.tensor(0))
        self.register_buffer("flag", torch.tensor(True))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls = self.calls + 1  # a new tensor each call, on every replica
        return self.lin(x), self.step, self.calls, self.flag


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_an_integer_buffer_returned_as_is_is_one_value(devices: list[str]) -> None:
    plain, wrapped = Step(), Step()
    model = dp.DataParallel(wrapped, devices)
    for _ in range(3):  # replicas reused: each call's copies, not the first call's
        x = torch.randn(6, 3)
        want, got = plain(x), model(x)
        assert_close_rel(got[0], want[0])
        for g, w in zip(got[1:], want[1:], strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), (got, want)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_waves_give_one_value_too(devices: list[str]) -> None:
    plain = Step()
    model = dp.DataParallel(Step(), devices, max_size=2)
    x = torch.randn(9, 3)
    want, got = plain(x), model(x)
    assert len(model.explain(x).waves) > 1
    # step and flag: one value. (calls counts forwards, and each wave is one: per wave.)
    assert (int(got[1]), bool(got[3])) == (int(want[1]), bool(want[3])) == (5, True)


class PassThrough(nn.Module):
    """Returns integer and boolean inputs it was given, beside a batched output."""

    def forward(
        self, x: torch.Tensor, k: torch.Tensor, opts: dict[str, Any], *, on: torch.Tensor
    ) -> tuple[Any, ...]:
        return x * 2, k, opts["n"], opts["shared"], on


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
@pytest.mark.parametrize("scalars", ["mean", "sum"])
def test_integer_and_boolean_inputs_passed_through_are_one_value(
    devices: list[str], scalars: str
) -> None:
    x = torch.randn(5, 3)
    opts = {"n": torch.tensor(7), "shared": dp.Shared(torch.tensor(2))}
    args = (x, torch.tensor(3), opts)
    plain_opts = {"n": opts["n"], "shared": torch.tensor(2)}
    want = PassThrough()(x, torch.tensor(3), plain_opts, on=torch.tensor(False))
    got = dp.DataParallel(PassThrough(), devices, scalars=scalars)(*args, on=torch.tensor(False))
    assert_close_rel(got[0], want[0])
    assert [t.item() for t in got[1:]] == [t.item() for t in want[1:]] == [3, 7, 2, False]


class Counts(nn.Module):
    """Counts computed from each chunk: equal on every replica, and equal to a buffer's value."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("two", torch.tensor(2))

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positive = (x > 0).sum()
        return positive, k + 0, self.two * 1  # computed: not the buffer or input themselves


@pytest.mark.parametrize("devices", DEVICE_LISTS[:2], ids=IDS[:2])
def test_counts_equal_to_a_buffer_or_input_are_still_counts(devices: list[str]) -> None:
    x = torch.tensor([[1.0], [1.0], [1.0], [1.0]])  # two positives per chunk, as the buffer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = dp.DataParallel(Counts(), devices)(x, torch.tensor(2))
    # one device: 4 positives; k + 0 and self.two * 1 are computed per chunk: counts, summed
    assert [int(t) for t in got] == [4, 4, 4]


class Scale(nn.Module):
    """A 0-dim parameter returned as is, under scalars='sum'."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.lin(x) * self.scale).sum(), self.scale


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_parameter_returned_under_sum_is_one_value_with_its_gradient(
    devices: list[str],
) -> None:
    torch.manual_seed(0)
    plain = Scale()
    wrapped = copy.deepcopy(plain)
    x = torch.randn(6, 3)
    total, scale = plain(x)
    (total + 10 * scale).backward()
    got_total, got_scale = dp.DataParallel(wrapped, devices, scalars="sum")(x)
    (got_total + 10 * got_scale).backward()
    assert_close_rel(got_total, total)
    assert_close_rel(got_scale, scale)
    for p, q in zip(wrapped.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close_rel(p.grad, q.grad)


class Finite(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x.sum() > 0)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_booleans_that_differ_are_refused_or_reduced_as_the_rule_says(devices: list[str]) -> None:
    x = torch.tensor([[5.0], [5.0], [-9.0], [-9.0], [-9.0], [-9.0]])  # one device: False
    with pytest.raises(ValueError, match=r"output\[1\]: the replicas returned different booleans"):
        dp.DataParallel(Finite(), devices)(x)
    for rule in ("all", "any"):
        got = dp.DataParallel(Finite(), devices, output_rules={"output[1]": rule})(x)
        assert got[1].dtype == torch.bool and bool(got[1]) is (rule == "any")
    assert bool(Finite()(x)[1]) is False


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_dropped_module_is_freed_after_a_count_was_looked_up(devices: list[str]) -> None:
    model = Step()
    ref = weakref.ref(model)
    wrapper = dp.DataParallel(model, devices)
    out = wrapper(torch.randn(4, 3))
    assert int(out[1]) == 5  # the buffer was looked up by name, so its place is kept
    del model, wrapper, out
    gc.collect()
    assert ref() is None
