"""CUDA paths the first GPU filing (issue 40) names, each against the plain module on cuda:0.

A device list that mixes a GPU and the CPU, ``compile=`` on CUDA replicas, and the tutorial CNN
trained for several steps with an optimizer on ``[0, 0]`` (two replicas on one GPU, the second
on a side stream). Skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp
from _close import assert_close_rel
from dataparallel.app.demo.models import Net

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _full_float32() -> object:
    """Chunked and whole-batch results agree in full float32 only (TF32 rounds per shape)."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _step_and_compare(model: nn.Module, ref: nn.Module, run: nn.Module, x: torch.Tensor) -> None:
    out, want = run(x), ref(x)
    assert out.device == want.device
    assert_close_rel(out, want, msg="output")
    out.square().mean().backward()
    want.square().mean().backward()
    for (name, got), exp in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert got.grad is not None and got.grad.device == exp.device, name
        assert_close_rel(got.grad, exp.grad, msg=f"grad of {name}")
    for (name, got), exp in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert_close_rel(got, exp, msg=f"buffer {name}")


@pytest.mark.parametrize("devices", [[0, "cpu"], ["cpu", 0]], ids=str)
def test_cuda_mixed_gpu_and_cpu_list_matches_one_device(devices: list[object]) -> None:
    """One replica on the GPU, one on the CPU: outputs on devices[0], gradients summed back
    onto the module's device. Batch statistics are replica 0's (the stated BatchNorm rule), so
    the reference runs replica 0's chunk for the buffers and the whole batch in eval mode."""
    torch.manual_seed(3)
    home = torch.device("cuda", 0) if devices[0] == 0 else torch.device("cpu")
    model = _mlp().eval().to(home)
    ref = copy.deepcopy(model)
    x = torch.randn(10, 6, device=home)
    _step_and_compare(model, ref, dp.DataParallel(model, devices), x)


def test_cuda_compiled_replicas_match_one_device() -> None:
    torch.manual_seed(4)
    model = _mlp().eval().cuda()
    ref = copy.deepcopy(model)
    x = torch.randn(12, 6, device="cuda:0")
    run = dp.DataParallel(model, [0, 0], compile={"backend": "inductor"})
    _step_and_compare(model, ref, run, x)
    model.zero_grad()
    ref.zero_grad()
    _step_and_compare(model, ref, run, torch.randn(9, 6, device="cuda:0"))  # a new shape


def test_cuda_training_steps_on_repeated_gpu_match_one_device() -> None:
    """Five SGD steps with momentum of the tutorial CNN on [0, 0]: the weights after each step
    equal the plain module's (batch statistics off: Net has no BatchNorm)."""
    torch.manual_seed(5)
    model = Net(1, 8, 10).cuda()
    ref = copy.deepcopy(model)
    run = dp.DataParallel(model, [0, 0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    gen = torch.Generator().manual_seed(6)
    for step, batch in enumerate([16, 9, 16, 1, 7]):
        x = torch.randn(batch, 1, 8, 8, generator=gen).cuda()
        y = torch.randint(0, 10, (batch,), generator=gen).cuda()
        for net, opt in zip((run, ref), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
        for (name, got), exp in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close_rel(got, exp, rtol=1e-5, msg=f"step {step}: {name}")
