"""Data a module only carries costs no search per call (issue 60, item 3), and a table that
grows is still watched in its new part.

Timings are in ``benchmarks/bench_carried_data.py``; here: the outcomes that made it slow or
serial before (a list of 30,000 small record dicts was "too large to search" and ran one
replica at a time), and that a module put into a large table later is still seen.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.replicate import serial_mark


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Carrier(nn.Module):
    """A linear layer with a table of records: forward counts each module the table holds."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.counter = Counter()
        self.table: list[Any] = [{"id": i, "label": f"l{i % 7}"} for i in range(rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for item in self.table[-3:]:
            if isinstance(item, nn.Module):
                item.calls += 1
        return self.lin(x)


def test_thirty_thousand_records_run_in_parallel_without_a_warning() -> None:
    model = Carrier(30_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before: "too large to search", serial
        replicas = dp.replicate(model, ["cpu", "cpu"])
    assert serial_mark(replicas) is None


@pytest.mark.parametrize("rows", [300, 30_000])
def test_a_module_appended_to_a_large_table_later_is_rebound(rows: int) -> None:
    ref = Carrier(rows)
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    for step in range(6):
        if step == 2:  # records appended, then the module: the table's new part is searched
            for model in (ref, par):
                model.table.extend({"id": -1} for _ in range(5))
        if step == 3:
            for model in (ref, par):
                model.table.append(model.counter)
        wrapper(x)
        ref(x)
        assert par.counter.calls == ref.counter.calls, f"call {step}"


@pytest.mark.parametrize("grown", [1, 5, 40])
def test_a_growing_table_whose_last_item_is_replaced_by_a_module(grown: int) -> None:
    # A history that grows by one record per call is compared at its sampled places, chosen
    # again only once it grew by one spacing of them (9 items at 300), and at its last item:
    # a module written over the newest record is seen after 1, 5 or 40 records.
    ref = Carrier(300)
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    for step in range(grown + 3):
        if step < grown:
            for model in (ref, par):
                model.table.append({"id": 1000 + step})
        elif step == grown:
            for model in (ref, par):
                model.table[-1] = model.counter
        wrapper(x)
        ref(x)
        assert par.counter.calls == ref.counter.calls, f"call {step}"
