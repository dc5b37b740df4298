"""A module whose forward changes its own state, and per-sample records with .to().

The rule (README, "Works with"): replica 0 is the module itself, so what its forward writes
(a buffer updated in place or reassigned, a plain attribute) lands on the module once per
call, from replica 0's chunk, as BatchNorm's running statistics do; the other replicas write
private copies that are dropped. A mutable attribute (a list) is shared by every replica, as
in torch: each replica's appends land in it, one per replica per call, in thread order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._oracle import LAYOUTS, check


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.attr_calls = 0
        self.log: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # in place on the buffer
        self.seen = self.seen + x.shape[0]  # a buffer reassigned
        self.attr_calls += 1
        self.log.append(x.shape[0])
        return self.lin(x)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_state_written_in_forward(devices: list[str], batch: int) -> None:
    x = torch.randn(batch, 4)
    ref, par = check("stateful module", Stateful(), (x,), {}, lambda o: o.sum(), devices)
    steps = 3
    # as on one device: one call counted per call
    assert int(ref.calls) == int(par.calls) == steps
    assert ref.attr_calls == par.attr_calls == steps
    # replica 0's chunk only, as BatchNorm's statistics
    first_chunk = -(-batch // len(devices))
    assert int(ref.seen) == steps * batch and int(par.seen) == steps * first_chunk
    # every replica appended to the one shared list
    assert ref.log == [batch] * steps
    assert sorted(par.log) == sorted(
        dp.DataParallel(nn.Identity(), devices).explain(x).chunk_sizes * steps
    )


def test_state_in_many_calls_never_races() -> None:
    model = Stateful()
    wrapped = dp.DataParallel(model, ["cpu"] * 4)
    for _ in range(50):
        wrapped(torch.randn(9, 4))
    assert int(model.calls) == model.attr_calls == 50
    assert len(model.log) == 200 and sum(model.log) == 450


@dataclasses.dataclass
class Sample:
    """A dataclass per-sample item: its tensors are moved field by field."""

    tokens: torch.Tensor
    name: str


class Record:
    """A record with its own .to (returns a new record, as tensors do)."""

    def __init__(self, values: torch.Tensor, device: str = "") -> None:
        self.values = values
        self.device = device

    def to(self, device: Any) -> Record:
        return Record(self.values.to(device), str(device))


class Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)

    def forward(self, records: list[Record], samples: list[Sample]) -> dict[str, Any]:
        x = torch.stack([r.values for r in records]) + torch.stack([s.tokens for s in samples])
        return {"y": self.lin(x), "where": [r.device for r in records]}


def test_records_and_dataclasses_are_split_per_sample_and_moved() -> None:
    gen = torch.Generator().manual_seed(0)
    records = [Record(torch.randn(3, generator=gen)) for _ in range(5)]
    samples = [Sample(torch.randn(3, generator=gen), f"s{i}") for i in range(5)]
    model = Reader()
    wrapped = dp.DataParallel(model, ["cpu", "cpu:1"])
    plan = wrapped.explain(records, samples)
    assert [e.rule for e in plan.entries] == ["per-sample", "per-sample"]
    assert "own .to(device)" in plan.entries[0].why
    out = wrapped(records, samples)
    assert out["where"] == ["cpu"] * 3 + ["cpu:1"] * 2
    ref = model(records, samples)
    assert torch.allclose(out["y"], ref["y"], atol=1e-6)
    assert all(r.device == "" for r in records)  # the caller's records are untouched
