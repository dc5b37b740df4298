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


# A forward hook of a module-level function that reads a global, as a script's hook does. A
# script's loop at module level writes its module's dictionary on every step, so the function's
# globals are compared by the names it reads, not by that dictionary's write version alone.
_TARGET: Any = None
_STEP = 0


def _count_target(module: nn.Module, inputs: Any, output: Any) -> None:
    if isinstance(_TARGET, Counter):
        _TARGET.calls += 1


def _hooked() -> Carrier:
    model = Carrier(4)
    model.register_forward_hook(_count_target)
    return model


def test_a_hook_whose_module_globals_move_every_step_is_not_compared_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    global _STEP
    from dataparallel.replicate import _holders

    wrapper = dp.DataParallel(_hooked(), ["cpu", "cpu"])
    x = torch.randn(4, 3)
    wrapper(x)
    read: list[Any] = []
    real = _holders.contents

    def counted(value: Any) -> list[Any]:
        if callable(value):
            read.append(value)
        return real(value)

    monkeypatch.setattr(_holders, "contents", counted)
    for _ in range(4):
        _STEP += 1  # the module's dictionary written, as a script's loop does
        wrapper(x)
    # before: the hook's whole contents (its code, cells and every global it reads) per call
    assert read == []
    assert wrapper(x).shape == (4, 2)


def test_a_global_a_hook_reads_rebound_to_a_module_is_seen_when_the_globals_move() -> None:
    global _STEP, _TARGET
    model = _hooked()
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    try:
        for step in range(7):
            _STEP += 1
            if step == 2:
                _TARGET = model.counter  # on one device: +1 per call from here on
            if step == 5:
                _TARGET = None  # and none from here on
            wrapper(x)
            assert model.counter.calls == min(max(0, step - 1), 3), f"call {step}"
    finally:
        _TARGET = None


def test_a_record_at_a_sampled_place_of_a_large_table_replaced_by_a_module() -> None:
    ref = Carrier(300)
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    for step in range(4):
        if step == 1:
            for model in (ref, par):
                model.table.append({"id": -1})  # grown: its new part searched
        if step == 2:  # the first item is always a sampled place; the last three are read
            for model in (ref, par):
                model.table[0] = model.counter
                model.table.extend([model.counter] * 3)
        wrapper(x)
        ref(x)
        assert par.counter.calls == ref.counter.calls, f"call {step}"


# A module-level hook that reads a step counter and a scale the script's loop rebinds on every
# step, as a logging hook does (issue 60's history row: 13.6 ms a call after 3,000 calls).
_LOG: list[dict[str, Any]] = []
_SCALE = 1.0


def _log_and_scale(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    _LOG.append({"step": _STEP, "rows": int(output.shape[0])})
    return output * _SCALE


def _fills(wrapper: dp.DataParallel) -> int:
    sets = wrapper.__dict__["_replica_sets"]
    return sum(entry.fills for entry in sets.sets.values())


def test_a_hook_reading_globals_a_loop_rebinds_to_plain_values_is_not_searched_again() -> None:
    global _STEP, _SCALE
    _LOG.extend({"step": -1, "rows": 0} for _ in range(300))  # a log past its first records
    model = Carrier(4)
    model.register_forward_hook(_log_and_scale)
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    try:
        wrapper(x)
        fills = _fills(wrapper)
        for step in range(5):
            _STEP += 1  # an int rebound, read by the hook
            _SCALE = 1.0 + step / 4  # a float rebound, read by the hook
            got = wrapper(x)
            with torch.no_grad():
                expected = model.lin(x) * _SCALE
            scale = expected.abs().max().item()
            assert (got - expected).abs().max().item() <= 1e-6 * scale, f"call {step}"
        # before: each call refilled the replicas and searched what the hook reaches again
        assert _fills(wrapper) == fills
    finally:
        _SCALE = 1.0
        _LOG.clear()


class Registry(nn.Module):
    """A large list that holds a module of the tree (so each replica holds its own copy) and
    records appended later; forward reads the list's length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.items: list[Any] = [self.lin, *({"id": i} for i in range(300))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * len(self.items)


def test_a_large_list_the_replicas_copy_grown_by_records_is_refilled() -> None:
    ref = Registry()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    for step in range(4):
        if step:
            for model in (ref, par):
                model.items.append({"id": -step})
        with torch.no_grad():
            got, expected = wrapper(x), ref(x)
        # before: replica 1 kept its copy of the list without the new records (off by 0.33)
        assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item(), step


class Stats(nn.Module):
    """A module that carries a small stats dict and a young history, both written by the
    training loop between calls (plain values only); forward reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.stats: dict[str, Any] = {"step": 0, "lr": 0.1}
        self.history: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (1 + self.stats["step"] * self.stats["lr"] + len(self.history))


def test_holders_changed_by_plain_values_between_calls_need_no_refill() -> None:
    ref = Stats()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    wrapper(x)
    fills = _fills(wrapper)
    for step in range(1, 6):
        for model in (ref, par):
            model.stats["step"] = step
            model.stats["lr"] = 0.1 / step
            model.history.append({"step": step, "loss": 0.5})
        with torch.no_grad():
            got, expected = wrapper(x), ref(x)
        assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item(), step
    # before: every call refilled the module's replicas and searched it again
    assert _fills(wrapper) == fills
    for model in (ref, par):  # a module put there later is still seen
        model.history.append(model.lin)
        model.stats["step"] = model.lin
    assert _fills(wrapper) == fills
    with torch.no_grad():
        wrapper.module.stats["step"] = 0
        ref.stats["step"] = 0
        got, expected = wrapper(x), ref(x)
    assert _fills(wrapper) == fills + 1
    assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


def test_a_history_that_starts_empty_is_compared_by_samples_once_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Taken as it grows (plain records), it must move to the large list's comparison once past
    # BIG items: read whole on every call, it would cost more as the run goes on.
    from dataparallel.replicate import _holders

    model = Carrier(4)
    history: list[Any] = []
    model.register_forward_hook(lambda m, i, o: history.append({"rows": int(o.shape[0])}))
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    x = torch.randn(4, 3)
    while len(history) <= _holders.BIG + 10:
        wrapper(x)
    read: list[Any] = []
    real = _holders.contents

    def counted(value: Any) -> list[Any]:
        if value is history:
            read.append(value)
        return real(value)

    monkeypatch.setattr(_holders, "contents", counted)
    for _ in range(3):
        wrapper(x)
    assert read == []
