"""``check=`` (issue 61): a call compared with the same call on one device, on a copy of the
module; each difference a ``dp.OneDeviceDifference`` naming its place, and the user's state left
as without the check."""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

CALLS: list[str] = []  # the forwards run, copies' included (a side effect outside the module)


class MinibatchStd(nn.Module):
    """rosinality/style-based-gan-pytorch's discriminator head: the minibatch standard
    deviation is taken over the batch inside forward, so over each chunk on each replica."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        std = h.var(0, unbiased=False).add(1e-8).sqrt().mean()
        return h, h + std


class BatchScaledGrad(torch.autograd.Function):
    """Identity forward; backward scales by the rows it sees (a backward that reads the batch)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.rows = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * ctx.rows


class Counted(nn.Module):
    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scaled = scaled
        self.calls = 0  # a Python attribute forward writes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        CALLS.append("forward")
        h = self.lin(x)
        return BatchScaledGrad.apply(h) if self.scaled else h


def _caught(fn: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if issubclass(w.category, dp.OneDeviceDifference)]


def test_a_batch_statistic_inside_forward_is_reported_by_path() -> None:
    torch.manual_seed(0)
    w = dp.DataParallel(MinibatchStd(), ["cpu", "cpu"], check=True)
    messages = _caught(lambda: w(torch.randn(8, 4))[1].sum().backward())
    assert len(messages) == 2, messages  # output[1], and the gradient through it
    assert messages[0].startswith("check=: differs from one device: output[1]: differs by")
    assert "no rule of the library covers it" in messages[0]
    assert "grad of lin.weight (through output[1])" in messages[1]
    assert issubclass(dp.OneDeviceDifference, UserWarning)
    assert "OneDeviceDifference" in dp.__all__
    # reported once per place
    assert _caught(lambda: dp.DataParallel.__call__(w, torch.randn(6, 4))) == []


def test_check_raise_raises_and_an_exact_module_passes() -> None:
    torch.manual_seed(0)
    w = dp.DataParallel(MinibatchStd(), ["cpu", "cpu"], check="raise")
    with pytest.raises(dp.OneDeviceDifference, match=r"output\[1\]"):
        w(torch.randn(8, 4))
    exact = dp.DataParallel(
        nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))),
        ["cpu", "cpu:1", "cpu:1"],
        check="raise",
    )
    for n in (8, 7, 8):
        exact(torch.randn(n, 4)).square().sum().backward()


def test_a_gradient_difference_is_reported_after_the_backward() -> None:
    w = dp.DataParallel(Counted(scaled=True), ["cpu", "cpu"], check=True)
    out = _caught(lambda: setattr(w, "_out", w(torch.randn(8, 4))))
    assert out == []  # the outputs are one device's
    loss = w.__dict__.pop("_out").square().sum()
    messages = _caught(loss.backward)
    assert {m.split(" (through")[0].split(": ")[-1] for m in messages} == {
        "grad of lin.weight",
        "grad of lin.bias",
    }
    assert "with the outputs the same, the backward differs" in messages[0]


def test_buffers_are_compared_after_the_call_and_name_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    w = dp.DataParallel(model, ["cpu", "cpu"], check=True)
    messages = _caught(lambda: w(torch.randn(8, 4)))
    places = [m.split(": ")[2] for m in messages]
    assert places == [
        "output",
        "buffer 1.running_mean after the call",
        "buffer 1.running_var after the call",
    ]
    assert all("convert_sync_batchnorm" in m for m in messages)


def test_the_users_state_is_as_without_the_check() -> None:
    """Parameters, buffers, gradients, the random stream and forward's attribute writes: the
    same three steps with and without the check (dropout: deterministic mode)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.3), nn.Linear(6, 3))
    results = []
    for check in (False, "raise"):
        model = copy.deepcopy(base)
        counted = Counted()
        counted.lin = model  # type: ignore[assignment]
        w = dp.DataParallel(counted, ["cpu", "cpu"], check=check, chunk_sizes=[4, 4])
        opt = torch.optim.SGD(counted.parameters(), lr=0.1)
        torch.manual_seed(3)
        with _deterministic():
            for _ in range(3):
                w(torch.randn(8, 4)).square().sum().backward()
                opt.step()
        draws = torch.rand(4)
        results.append((counted, draws))
    (plain, a), (checked, b) = results
    assert torch.equal(a, b)
    assert checked.calls == plain.calls == 3
    for (name, p), q in zip(plain.state_dict().items(), checked.state_dict().values(), strict=True):
        assert_close_rel(q, p, msg=name)
    for p, q in zip(plain.parameters(), checked.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close_rel(q.grad, p.grad)


class _deterministic:
    def __enter__(self) -> None:
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc: object) -> None:
        torch.use_deterministic_algorithms(self.was)


def test_which_calls_are_checked() -> None:
    """The first call of each signature (and after a rebuild); ``check_every=1``: every call."""
    w = dp.DataParallel(Counted(), ["cpu", "cpu"], check=True)
    runs = []
    for n in (8, 8, 6, 6):
        CALLS.clear()
        w(torch.randn(n, 4)).sum().backward()
        runs.append(len(CALLS))
    assert runs == [3, 2, 3, 2]  # two replicas, plus the copy on a checked call
    w.check_every = 1
    CALLS.clear()
    w(torch.randn(8, 4)).sum().backward()
    assert len(CALLS) == 3
    with pytest.raises(ValueError, match="check_every: expected an int >= 0"):
        w.check_every = -1


def test_calls_before_the_backward_run_on_the_copy_too() -> None:
    """Two forwards, then one backward: the copy follows both, as one device runs them."""
    w = dp.DataParallel(Counted(), ["cpu", "cpu"], check="raise")
    CALLS.clear()
    a, b = w(torch.randn(8, 4)), w(torch.randn(8, 4))
    (a.sum() + b.sum()).backward()
    w(torch.randn(8, 4)).sum().backward()  # after the backward: not checked
    assert len(CALLS) == 3 + 3 + 2


def test_off_nothing_runs() -> None:
    w = dp.DataParallel(Counted(), ["cpu", "cpu"])
    w(torch.randn(8, 4)).sum().backward()
    assert w.check_mode is None and "_one_device" not in w.__dict__


def test_the_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAPARALLEL_CHECK", "raise")
    with pytest.raises(dp.OneDeviceDifference):
        dp.DataParallel(MinibatchStd(), ["cpu", "cpu"])(torch.randn(8, 4))
    assert dp.DataParallel(MinibatchStd(), ["cpu", "cpu"], check=False).check_mode is None
    monkeypatch.setenv("DATAPARALLEL_CHECK", "1")
    assert dp.DataParallel(MinibatchStd(), ["cpu", "cpu"]).check_mode == "warn"
    monkeypatch.setenv("DATAPARALLEL_CHECK", "maybe")
    with pytest.raises(ValueError, match="DATAPARALLEL_CHECK: expected True, 'raise'"):
        dp.DataParallel(MinibatchStd(), ["cpu", "cpu"])


def test_a_bad_value_is_refused_and_a_built_wrapper_can_change_its_mode() -> None:
    with pytest.raises(ValueError, match="check: expected True, 'raise', False or None"):
        dp.DataParallel(MinibatchStd(), ["cpu", "cpu"], check="always")
    w = dp.DataParallel(MinibatchStd(), ["cpu", "cpu"], check=False)
    w(torch.randn(8, 4))  # off: nothing said
    w.check_mode = "raise"
    with pytest.raises(dp.OneDeviceDifference):
        w(torch.randn(8, 4))
    with pytest.raises(ValueError, match="check: expected"):
        w.check_mode = "always"


def test_a_module_that_cannot_be_copied_is_said_once() -> None:
    model = Counted()
    model.lock = threading.Lock()  # type: ignore[assignment]
    w = dp.DataParallel(model, ["cpu", "cpu"], check="raise")
    with pytest.warns(UserWarning, match="check=: the module cannot be deep-copied") as seen:
        out = w(torch.randn(8, 4))
        w(torch.randn(6, 4))
    assert len([m for m in seen if "check=" in str(m.message)]) == 1
    assert out.shape == (8, 3)


def test_explain_mentions_it() -> None:
    x = torch.randn(8, 4)
    notes = dp.DataParallel(Counted(), ["cpu", "cpu"], check=True).explain(x).notes
    assert any(n.startswith("check=: the call is compared") for n in notes)
    assert dp.DataParallel(Counted(), ["cpu", "cpu"]).explain(x).notes == []
