"""A replica is a module in its own right inside forward (issue 29, item 2).

``self.parameters()``, ``named_parameters()``, ``buffers()``, ``named_buffers()`` and
``state_dict()`` called on a replica inside its forward see that replica's tensors (torch's
DataParallel returns no parameters there: the "StopIteration in replica 1"), and gradients
flow back to the module's parameters. Oracle: the same module run plainly on one device.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
IDS = ["shared", "copied", "mixed"]


class Regularised(nn.Module):
    """A loss with an L2 regulariser summed over ``self.parameters()`` inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        device = next(self.parameters()).device  # a bare StopIteration in torch's replicas
        pred = self.out(torch.relu(self.bn(self.fc(x.to(device)))))
        reg = sum(p.pow(2).sum() for p in self.parameters())
        return nn.functional.mse_loss(pred, y) + 0.1 * reg


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_regulariser_over_self_parameters_gives_the_one_device_loss(devices: list[str]) -> None:
    # The regulariser is the same on every replica; the gather's chunk-weighted mean of
    # (chunk loss + reg) is then (batch loss + reg), the one-device value, and each replica's
    # share of the regulariser's gradient is its chunk weight, summing to one.
    torch.manual_seed(0)
    model = Regularised().eval()  # eval: BatchNorm's running statistics, chunks independent
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    x, y = torch.randn(7, 4), torch.randn(7, 2)
    for _ in range(2):  # the second call goes through the warm path
        model.zero_grad()
        oracle.zero_grad()
        loss = wrapper(x, y)
        expected = oracle(x, y)
        assert_close_rel(loss, expected, msg="loss")
        loss.backward()
        expected.backward()
        mine, theirs = _grads(model), _grads(oracle)
        assert mine.keys() == theirs.keys() == dict(model.named_parameters()).keys()
        for name in mine:
            assert_close_rel(mine[name], theirs[name], msg=name)


class Introspective(nn.Module):
    """Records, per replica, what the replica's own introspection methods return."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("gain", torch.full((3,), 2.0))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        with self.lock:
            self.seen.append(
                {
                    "self": self,
                    "params": params,
                    "param_list": list(self.parameters()),
                    "buffers": buffers,
                    "buffer_list": list(self.buffers()),
                    "state": self.state_dict(),
                    "fc": self.fc,
                    "bn": self.bn,
                }
            )
        return self.bn(self.fc(x)) * self.gain


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_introspection_inside_forward_sees_the_replicas_own_tensors(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Introspective().eval()  # state_dict values are views: no update after they are read
    before = {k: v.clone() for k, v in model.state_dict().items()}
    replicas = dp.replicate(model, devices)
    for r, chunk in zip(
        replicas, torch.randn(3 * len(devices), 4).chunk(len(devices)), strict=True
    ):
        r(chunk)
    names = [n for n, _ in model.named_parameters()]
    buffer_names = [n for n, _ in model.named_buffers()]
    state_keys = list(model.state_dict())
    assert len(model.seen) == len(devices)
    for seen, replica in zip(model.seen, replicas, strict=True):
        assert seen["self"] is replica
        # The very tensors the replica computes with: its attributes, in the module's order.
        assert list(seen["params"]) == names
        expected = [seen["fc"].weight, seen["fc"].bias, seen["bn"].weight, seen["bn"].bias]
        assert all(a is b for a, b in zip(seen["param_list"], expected, strict=True))
        assert all(seen["params"][n] is p for n, p in zip(names, expected, strict=True))
        assert list(seen["buffers"]) == buffer_names
        assert seen["buffers"]["bn.running_mean"] is seen["bn"].running_mean
        assert len(seen["buffer_list"]) == len(buffer_names)
        # state_dict: the module's keys (persistent buffers only), the replica's values.
        assert list(seen["state"]) == state_keys
        for key, value in before.items():  # taken before any replica's BatchNorm ran
            assert_close_rel(seen["state"][key], value, msg=key)
    # Nothing of the replicas leaks into the module.
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == state_keys


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_replicas_parameters_carry_gradients_to_the_module(devices: list[str]) -> None:
    # Each replica's output is the sum of its own parameters (through self.parameters()):
    # the gradient reaching every parameter is the number of replicas, as one device run
    # once per replica would give.
    class SumOfParameters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            total = sum(p.sum() for p in self.parameters())
            return x.sum(dim=1) * 0 + total

    model = SumOfParameters()
    outs = [r(torch.ones(1, 2)) for r in dp.replicate(model, devices)]  # one row per replica
    torch.cat(outs).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, torch.full_like(p, float(len(devices))))


def test_an_lstm_replica_lists_its_flat_weights_as_parameters() -> None:
    torch.manual_seed(0)
    model = nn.LSTM(4, 5, batch_first=True)
    replicas = dp.replicate(model, ["cpu", "cpu:1"])
    names = [n for n, _ in model.named_parameters()]
    for replica in replicas:
        assert [n for n, _ in replica.named_parameters()] == names
        assert all(
            p is getattr(replica, n) for n, p in replica.named_parameters()
        )  # the tensors its forward uses
    out = replicas[1](torch.randn(2, 3, 4))[0]
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
