"""``python -m benchmarks.bench_carried_data [--calls N] [--out FILE]``: the cost of a wrapped
call when the module carries data that leads to no module (issue 60, item 3).

A small MLP on two CPU replicas, in inference, with nothing attached (the bare call), then with
each of: a vocabulary dict of 50,000 words, an index-to-word list of 50,000 strings, 30,000
small record dicts, a numpy count table of 64 KiB (the arrays read by their bytes on every
call are at most that much), a numpy table of 8 MB (past that: not read), and a forward hook
whose history list gets one record per call (timed after 3,000 calls, and again after
``--calls`` more); then a hook defined at module level, whose module's dictionary is written
before every call, as a script's loop writes it. Each row: the best of 5 rounds of the median
call, its ratio to the bare call timed in rounds interleaved with that row's (so a machine
whose speed drifts during the run moves both sides of each ratio alike), and whether the
replicas ran serially (a search cut short). Goal: every ratio at most
1.3, the history row flat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import dataparallel as dp
from dataparallel.replicate import serial_mark
from dataparallel.replicate._kinds import ARRAY_BYTES

__all__ = ["main"]

_X = torch.randn(16, 32)
# The row of a hook defined at module level, as in a script: its globals are this module's,
# written on every step (``_STEP``) as a script's loop at module level writes its own.
_HISTORY: list[dict[str, Any]] = []
_STEP = 0


def _log_at_module_level(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
    _HISTORY.append({"call": len(_HISTORY), "step": _STEP, "rows": int(output.shape[0])})


def _stepped(call: Any) -> Any:
    """``call`` with this module's dictionary written before each call, as a script's loop
    writes its loop variable."""

    def step(x: torch.Tensor) -> Any:
        global _STEP
        _STEP += 1
        return call(x)

    return step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _time(wrapper: Any, calls: int = 200, rounds: int = 5, bare: Any = None) -> tuple[float, float]:
    """The best of ``rounds`` medians of ``calls`` timed calls, in microseconds, and the same
    for ``bare``, timed in rounds alternating with these (``inf`` without one)."""
    best = float("inf")
    best_bare = float("inf")
    with torch.no_grad():
        for _ in range(rounds):
            for who in (wrapper, bare):
                if who is None:
                    continue
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    who(_X)
                    times.append(time.perf_counter() - start)
                if who is wrapper:
                    best = min(best, statistics.median(times))
                else:
                    best_bare = min(best_bare, statistics.median(times))
    return best * 1e6, best_bare * 1e6


def _serial(model: nn.Module) -> bool:
    return serial_mark(dp.replicate(model, ["cpu", "cpu"])) is not None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    plain = dp.DataParallel(_model(), ["cpu", "cpu"])
    bare, _ = _time(plain)
    rows.append({"case": "bare", "us": round(bare, 1), "ratio": 1.0, "serial": False})

    def row(name: str, model: nn.Module, timed: tuple[float, float]) -> None:
        us, bare_us = timed
        rows.append(
            {
                "case": name,
                "us": round(us, 1),
                "bare_us": round(bare_us, 1),
                "ratio": round(us / bare_us, 2),
                "serial": _serial(model),
            }
        )

    model = _model()
    model.vocab = {f"word{i}": i for i in range(50_000)}
    row("vocab_dict_50k", model, _time(dp.DataParallel(model, ["cpu", "cpu"]), bare=plain))
    model = _model()
    model.itos = [f"word{i}" for i in range(50_000)]
    row("itos_list_50k", model, _time(dp.DataParallel(model, ["cpu", "cpu"]), bare=plain))
    model = _model()
    model.records = [{"id": i, "label": f"l{i % 7}", "weight": 0.5} for i in range(30_000)]
    row("records_30k", model, _time(dp.DataParallel(model, ["cpu", "cpu"]), bare=plain))
    model = _model()
    model.counts = np.zeros(ARRAY_BYTES // 8)  # read by its bytes before and after each call
    row("count_table_64k", model, _time(dp.DataParallel(model, ["cpu", "cpu"]), bare=plain))
    model = _model()
    model.embeddings = np.zeros((50_000, 20))  # past the budget: data, not read
    row("embedding_table_8m", model, _time(dp.DataParallel(model, ["cpu", "cpu"]), bare=plain))

    model = _model()
    history: list[dict[str, Any]] = []

    def log(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        history.append({"call": len(history), "rows": int(output.shape[0])})

    model.register_forward_hook(log)
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    with torch.no_grad():
        while len(history) < 3_000:
            wrapper(_X)
    row("history_hook_after_3k", model, _time(wrapper, bare=plain))
    with torch.no_grad():
        for _ in range(args.calls):
            wrapper(_X)
    row(f"history_hook_after_{args.calls // 1000}k_more", model, _time(wrapper, bare=plain))

    model = _model()
    model.register_forward_hook(_log_at_module_level)
    wrapper = _stepped(dp.DataParallel(model, ["cpu", "cpu"]))
    with torch.no_grad():
        while len(_HISTORY) < 3_000:
            wrapper(_X)
    row("module_level_hook_after_3k", model, _time(wrapper, bare=_stepped(plain)))
    report = {"benchmark": "carried_data", "unit": "us per call", "rows": rows}
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
