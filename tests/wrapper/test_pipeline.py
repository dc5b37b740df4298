"""DataParallel's one pipeline: overrides decided at construction, the one-device case as a
one-chunk plan that moves nothing, and the same results as the plain module (oracle)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.wrapper._waves import Overrides

CPU2 = ["cpu", "cpu"]


class Echo(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return args, kwargs


def test_overrides_are_decided_at_construction() -> None:
    class Gathers(dp.DataParallel):
        def gather(self, outputs: Any, output_device: Any) -> Any:
            return ["gathered", len(outputs)]

    plain = dp.DataParallel(nn.Linear(3, 2), CPU2)
    mine = Gathers(nn.Linear(3, 2), CPU2)
    assert plain.__dict__["_steps"] == Overrides(False, False, False, False)
    assert mine.__dict__["_steps"] == Overrides(False, False, False, True)
    assert mine(torch.randn(4, 3)) == ["gathered", 2]


def test_overridden_scatter_parallel_apply_and_gather_are_each_honoured() -> None:
    calls: list[str] = []

    class Custom(dp.DataParallel):
        def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
            calls.append("scatter")
            (x,) = inputs
            return ((x[:1],), (x[1:],)), ({}, {})  # an uneven split of its own

        def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> Any:
            calls.append("parallel_apply")
            return super().parallel_apply(replicas, inputs, kwargs)

        def gather(self, outputs: Any, output_device: Any) -> Any:
            calls.append("gather")
            return super().gather(outputs, output_device)

    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    model = Custom(lin, CPU2)
    for _ in range(2):
        torch.testing.assert_close(model(x), lin(x))
    assert calls == ["scatter", "parallel_apply", "gather"] * 2
    assert model.last_call is not None and model.last_call.chunk_sizes == [1, 4]


def test_a_wrapper_without_the_record_decides_at_its_first_call() -> None:
    class Gathers(dp.DataParallel):
        def gather(self, outputs: Any, output_device: Any) -> Any:
            return "mine"

    model = Gathers(nn.Linear(3, 2), CPU2)
    del model.__dict__["_steps"]  # as unpickled from a version that had none
    old = copy.deepcopy(model)  # (a local class does not pickle; a copy goes the same way)
    assert "_steps" not in old.__dict__
    assert old(torch.randn(4, 3)) == "mine"
    assert old.__dict__["_steps"].gather


def test_copies_keep_the_record() -> None:
    model = dp.DataParallel(nn.Linear(3, 2), ["cpu"])
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.__dict__["_steps"] == model.__dict__["_steps"]
        assert other(torch.randn(2, 3)).shape == (2, 2)


@pytest.mark.parametrize("training", [True, False])
def test_one_device_outputs_and_gradients_equal_the_plain_module(training: bool) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    ref = copy.deepcopy(net)
    net.train(training)
    ref.train(training)
    model = dp.DataParallel(net, ["cpu"])
    for _ in range(3):  # the plan is reused from the second call on
        x = torch.randn(6, 4)
        out, want = model(x), ref(x)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
        out.pow(2).sum().backward()
        want.pow(2).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0)
    for a, b in zip(net.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(a, b)


def test_one_device_scatter_moves_nothing_through_a_reused_plan() -> None:
    model = dp.DataParallel(Echo(), ["cpu"])
    for _ in range(3):
        x, mask = torch.randn(5, 2), torch.ones(5)
        args, kwargs = model(x, mask=mask)
        assert args[0] is x and kwargs["mask"] is mask
        assert model.last_call is not None and model.last_call.chunk_sizes == [5]
    cast = dp.DataParallel(Echo(), ["cpu"], dtype=torch.float64)
    for _ in range(2):  # a cast is a move: the reused plan still casts
        ((y,), _) = cast(torch.randn(3, 2))
        assert y.dtype == torch.float64


def test_one_device_error_names_the_replica_and_inputs() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = dp.DataParallel(Boom(), ["cpu"])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"replica 0 on cpu, inputs \(Tensor\[3, 2\]\): boom"):
            model(torch.zeros(3, 2))


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, batch: dict[str, Any], extra: list[torch.Tensor]) -> dict[str, Any]:
        out = self.lin(batch["x"] * batch["mask"]) + extra[0].sum()
        return {"out": out, "names": batch["names"]}


def test_one_device_call_of_containers_takes_the_whole_batch_plan() -> None:
    # Containers are not in the plan cache: on one device the plan is the whole batch,
    # decided by the vote alone, and every result equals the plain module's.
    torch.manual_seed(0)
    net = DictNet()
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, ["cpu"])
    for batch_size in (5, 5, 3):
        x, mask = torch.randn(batch_size, 4), torch.ones(batch_size, 4)
        names = [f"s{i}" for i in range(batch_size)]
        table = [torch.randn(7, 2)]  # not batched: the vote still says batch_size
        out = model({"x": x, "mask": mask, "names": names}, dp.Shared(table))
        want = ref({"x": x, "mask": mask, "names": names}, table)
        torch.testing.assert_close(out["out"], want["out"], atol=1e-5, rtol=0)
        assert out["names"] == names
        assert model.last_call is not None and model.last_call.chunk_sizes == [batch_size]
        out["out"].sum().backward()
        want["out"].sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0)


def test_one_device_containers_the_vote_cannot_settle_take_the_full_plan() -> None:
    model = dp.DataParallel(Echo(), ["cpu"])
    # A dp.Split decides B (not the vote); a marker is unwrapped either way.
    (seq,), _ = model(dp.Split([1, 2, 3]))
    assert seq == [1, 2, 3] and model.last_call.chunk_sizes == [3]
    # Nested deeper than the walk that moves tensors goes: the full plan names the input, as
    # it does on several devices.
    deep: Any = torch.zeros(2)
    for _ in range(150):
        deep = [deep]
    with pytest.raises(ValueError, match=r"args\[1\]: containers nested more than 100"):
        model(torch.zeros(4, 1), dp.Shared(deep))
    # B = 0 runs the module on its own empty inputs, as on every path
    (empty, items), _ = model(torch.zeros(0, 2), [torch.zeros(0)])
    assert empty.shape == (0, 2) and items[0].shape == (0,)
    assert model.last_call.chunk_sizes == [0]
