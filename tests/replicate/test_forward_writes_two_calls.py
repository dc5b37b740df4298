"""Two forwards, then one backward, with ``.data`` writes of frozen parameters in forward
(issue 61, third family).

heykeetae/Self-Attention-GAN's spectral norm assigns ``u.data`` and ``v.data`` (parameters
that do not require grad) on every call, and ``sigma = u.dot(w.mv(v))`` saves ``u`` and ``v``
for backward. A GAN step runs the discriminator twice (real, fake), then one backward: on one
device the first call's backward reads the ``u``, ``v`` the second call wrote, since the saved
tensors are the module's own, whose data was rebound. The replicas after the first kept a new
private copy per call (and the assignment's new address rebuilt the replica set on every call),
so the first call's backward read that call's own values: the weight's gradient below off by
8e-4 of its magnitude on two replicas, 1.2e-3 on three. Each replica now keeps its copy as one
tensor object across calls, its data rebound to the module's value at each call.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"], ["cpu"] * 3]


class SpectralLinear(nn.Module):
    """A linear layer normalised by its spectral norm, estimated as the script does: one power
    iteration per call written into frozen ``u``, ``v`` through ``.data``, and ``sigma`` from
    them with ``u``, ``v`` saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(5, 4))
        self.u = nn.Parameter(torch.randn(5), requires_grad=False)
        self.v = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        self.v.data = nn.functional.normalize(w.data.t().mv(self.u.data), dim=0)
        self.u.data = nn.functional.normalize(w.data.mv(self.v.data), dim=0)
        sigma = self.u.dot(w.mv(self.v))
        return x @ (w / sigma).t()


def _two_calls_one_backward(run: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    """Three discriminator steps as the script takes them; each step's losses."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        real, fake = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
        loss = torch.relu(1.0 - run(real)).mean() + torch.relu(1.0 + run(fake)).mean()
        loss.backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_the_first_calls_backward_reads_what_the_second_call_wrote(devices: list[str]) -> None:
    ref = SpectralLinear()
    model = copy.deepcopy(ref)
    want = _two_calls_one_backward(ref)
    got = _two_calls_one_backward(dp.DataParallel(model, devices))
    for a, b in zip(got, want, strict=True):
        assert_close_rel(a, b)
    assert ref.w.grad is not None and model.w.grad is not None
    # before: off by 8e-4 of its magnitude on two replicas, 1.2e-3 on three
    assert_close_rel(model.w.grad, ref.w.grad, msg="grad of w")
    assert_close_rel(model.u, ref.u, msg="u")
    assert_close_rel(model.v, ref.v, msg="v")


def test_a_data_assignment_of_the_same_placement_keeps_the_replicas() -> None:
    """``u.data = t`` on every call moves the data to a new address: the replica set follows
    it without being built again (before: a rebuild, and a refill, on every call)."""
    model = SpectralLinear()
    first = dp.replicate(model, ["cpu", "cpu:1"])
    model.u.data = torch.randn(5)
    again = dp.replicate(model, ["cpu", "cpu:1"])
    assert again[1] is first[1]
    assert torch.equal(again[1].u, model.u)


def test_a_dtype_change_still_builds_the_replicas_again() -> None:
    model = SpectralLinear()
    first = dp.replicate(model, ["cpu", "cpu:1"])
    model.double()
    again = dp.replicate(model, ["cpu", "cpu:1"])
    assert again[1] is not first[1]
    assert again[1].w.dtype == torch.float64 and again[1].u.dtype == torch.float64


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_a_rebuild_between_the_two_calls_keeps_the_copies(devices: list[str]) -> None:
    """A buffer registered between the two forwards rebuilds the replica set: the new set
    takes over the old one's copies, so the first call's backward still reads the second
    call's write."""
    ref = SpectralLinear()
    model = copy.deepcopy(ref)
    wrapper = dp.DataParallel(model, devices)
    gen = torch.Generator().manual_seed(2)
    real, fake = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    for run, module in ((ref, ref), (wrapper, model)):
        first = torch.relu(1.0 - run(real)).mean()
        module.register_buffer("seen", torch.zeros(()))
        (first + torch.relu(1.0 + run(fake)).mean()).backward()
    assert ref.w.grad is not None and model.w.grad is not None
    assert_close_rel(model.w.grad, ref.w.grad, msg="grad of w")
