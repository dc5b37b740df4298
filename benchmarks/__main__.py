"""``python -m benchmarks [--quick] [--runs N] [--out FILE]``: run the CPU set, write JSON, print
a table.

The full set adds mmcv 1.x's scatter (where installed) and the DDP path of ``bench_ddp.py``
(two gloo processes) to the quick set. Results go to ``--out``, by default
``benchmarks/results/<timestamp>.json`` (git-ignored; ``latest-cpu.json`` is the committed
full run of the reference machine).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import FULL, QUICK, CaseFn
from benchmarks.harness import (
    Case,
    Settings,
    format_table,
    machine_info,
    merge_runs,
    write_report,
)

__all__ = ["FULL_SETTINGS", "QUICK_SETTINGS", "main", "run", "run_quick"]

RESULTS = Path(__file__).resolve().parent / "results"
FULL_SETTINGS = Settings(repeats=21, min_block_s=0.1, warmup=3)
QUICK_SETTINGS = Settings(repeats=9, min_block_s=0.04, warmup=2)


def _default_out() -> Path:
    return RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}.json"


def run(
    suite: Sequence[CaseFn],
    settings: Settings,
    out: str | Path | None,
    *,
    name: str,
    threads: int | None = 1,
    echo: bool = True,
    runs: int = 1,
) -> dict[str, Any]:
    """Run ``suite`` under ``settings``, write the JSON report to ``out``, return it.

    ``threads`` pins torch's intra-op threads (1 by default: on a shared machine one thread
    per contender keeps the two sides of a ratio from fighting over cores); ``None`` leaves
    torch's default. ``runs`` > 1 runs the whole suite that many times and reports each case's
    median run, with every run's ratio and the spread (``harness.merge_runs``), and each run's
    load average when it began.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    results: list[list[Case]] = []
    seen: list[dict[str, Any]] = []
    try:
        for r in range(runs):
            began = time.perf_counter()
            load = machine_info()["load_average_1_5_15"]
            cases: list[Case] = []
            for fn in suite:
                if echo:
                    print(f"running {fn.__name__} ({r + 1}/{runs}) ...", flush=True)
                cases.extend(fn(settings))
            results.append(cases)
            seen.append({"load_average_1_5_15": load, "seconds": time.perf_counter() - began})
        cases = merge_runs(results) if runs > 1 else results[0]
        path = Path(out) if out is not None else _default_out()
        report = write_report(
            cases,
            path,
            suite=name,
            settings=settings,
            seconds=time.perf_counter() - start,
            runs=seen if runs > 1 else (),
        )
    finally:
        torch.set_num_threads(before)
    if echo:
        print(format_table(cases))
        summary = report["summary"]
        print(
            f"{summary['met']} met, {summary['missed']} missed, {summary['info']} for "
            f"information, {summary['skipped']} skipped; wrote {path}"
        )
    return report


def run_quick(out: str | Path | None = None, settings: Settings | None = None) -> dict[str, Any]:
    """The quick set (``dataparallel bench``): JSON to ``out`` (default: a timestamped file)."""
    return run(QUICK, settings or QUICK_SETTINGS, out, name="quick")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the chosen set, print the table; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="dataparallel's CPU benchmarks, with ratios"
    )
    parser.add_argument("--quick", action="store_true", help="the quick set only")
    parser.add_argument("--out", help="JSON file (default: benchmarks/results/<timestamp>.json)")
    parser.add_argument("--repeats", type=int, help="timed blocks per contender")
    parser.add_argument("--min-time", type=float, help="least seconds per timed block")
    parser.add_argument("--warmup", type=int, help="untimed calls before calibration")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run the whole set this many times; report each case's median run and the spread",
    )
    args = parser.parse_args(argv)
    base = QUICK_SETTINGS if args.quick else FULL_SETTINGS
    for flag, value, low in (
        ("--repeats", args.repeats, 1),
        ("--warmup", args.warmup, 0),
        ("--runs", args.runs, 1),
    ):
        if value is not None and value < low:
            parser.error(f"{flag}: expected an integer >= {low}, got {value}")
    if args.min_time is not None and not args.min_time > 0:
        parser.error(f"--min-time: expected seconds > 0, got {args.min_time}")
    settings = Settings(
        repeats=base.repeats if args.repeats is None else args.repeats,
        min_block_s=base.min_block_s if args.min_time is None else args.min_time,
        warmup=base.warmup if args.warmup is None else args.warmup,
    )
    run(
        QUICK if args.quick else FULL,
        settings,
        args.out,
        name="quick" if args.quick else "full",
        threads=args.threads or None,
        runs=args.runs,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
