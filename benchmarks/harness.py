"""The timing harness: interleaved repeats, medians, ratios, JSON and a table.

``torch.utils.benchmark.Timer`` times one statement at a time; a ratio needs the baseline and
the measured case side by side, so that a noisy neighbour or a clock change hits both. Here
every repeat times each contender once, back to back, in an order that rotates from repeat to
repeat; each timing is a block of calls long enough to dwarf the clock's resolution (the block
length is calibrated once, per contender, after a warm-up), with the garbage collector off
inside a block, as ``timeit`` does. A case's ratio is the median of the per-repeat ratios
(each from one repeat's back-to-back pair), which cancels slow drifts better than the ratio of
the two medians; both are reported.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SCHEMA",
    "Case",
    "Settings",
    "Stats",
    "compare",
    "format_table",
    "machine_info",
    "merge_runs",
    "paired_ratio",
    "write_report",
]

SCHEMA = "dataparallel-bench/1"


@dataclass(frozen=True)
class Settings:
    """How hard to measure.

    Args:
        repeats: timed blocks per contender (the sample size of each median).
        min_block_s: the least duration of one timed block; calls per block are chosen so.
        warmup: untimed calls of each contender before calibration.
    """

    repeats: int = 15
    min_block_s: float = 0.05
    warmup: int = 3


@dataclass(frozen=True)
class Stats:
    """Per-call seconds of one contender over the repeats."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int
    calls_per_repeat: int
    samples: list[float]

    @classmethod
    def of(cls, samples: Sequence[float], calls: int) -> Stats:
        values = sorted(samples)
        if len(values) >= 2:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        else:
            q1 = q3 = values[0]
        return cls(
            statistics.median(values),
            q1,
            q3,
            values[0],
            values[-1],
            len(values),
            calls,
            list(samples),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "median_s": self.median,
            "q1_s": self.q1,
            "q3_s": self.q3,
            "iqr_s": self.q3 - self.q1,
            "min_s": self.min,
            "max_s": self.max,
            "n": self.n,
            "calls_per_repeat": self.calls_per_repeat,
            "samples_s": self.samples,
        }


@dataclass
class Case:
    """One benchmark case: its contenders' figures, the ratio to the baseline, the target.

    ``op`` is ``"<="`` or ``">="`` (the ratio against ``target``), or ``"in"`` with
    ``target`` a ``[low, high]`` range; ``target=None`` is a figure reported for information.
    A case with ``skipped`` set measured nothing, and says why.
    """

    name: str
    title: str
    baseline: str | None = None
    measured: str | None = None
    stats: dict[str, Stats] = field(default_factory=dict)
    ratio: float | None = None
    ratio_of_medians: float | None = None
    ratio_what: str = ""
    op: str = "<="
    target: float | list[float] | None = None
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        if self.skipped is not None or self.target is None or self.ratio is None:
            return None
        if self.op == "<=":
            return self.ratio <= self.target  # type: ignore[operator]
        if self.op == ">=":
            return self.ratio >= self.target  # type: ignore[operator]
        low, high = self.target  # type: ignore[misc]
        return bool(low <= self.ratio <= high)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "status": "skipped" if self.skipped is not None else "ok",
            "skipped_reason": self.skipped,
            "baseline": self.baseline,
            "measured": self.measured,
            "stats": {label: s.to_json() for label, s in self.stats.items()},
            "ratio": self.ratio,
            "ratio_of_medians": self.ratio_of_medians,
            "ratio_what": self.ratio_what,
            "target": None if self.target is None else {"op": self.op, "value": self.target},
            "met": self.met,
            "extra": self.extra,
        }


def _block(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls, the collector off (as timeit)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls
    finally:
        if enabled:
            gc.enable()


def _calibrate(fn: Callable[[], object], settings: Settings) -> int:
    for _ in range(settings.warmup):
        fn()
    calls = 1
    while True:
        per_call = _block(fn, calls)
        if per_call * calls >= settings.min_block_s or calls >= 1 << 20:
            return calls
        # Aim a little past the target, at most 10x more per step.
        wanted = settings.min_block_s / max(per_call, 1e-9) * 1.2
        calls = max(calls + 1, min(int(wanted), calls * 10))


def compare(contenders: Mapping[str, Callable[[], object]], settings: Settings) -> dict[str, Stats]:
    """Time every contender ``settings.repeats`` times, interleaved; per-call seconds.

    Each repeat times every contender once, back to back; the order rotates by one from
    repeat to repeat (for two contenders: AB, BA, AB, ...), so neither always goes first.
    The collector runs between repeats, not inside a block.
    """
    names = list(contenders)
    calls = {name: _calibrate(contenders[name], settings) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(settings.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_block(contenders[name], calls[name]))
        gc.collect()
    return {name: Stats.of(samples[name], calls[name]) for name in names}


def paired_ratio(measured: Stats, baseline: Stats) -> tuple[float, float]:
    """(median of per-repeat ratios, ratio of medians) of ``measured`` over ``baseline``."""
    per_repeat = [m / b for m, b in zip(measured.samples, baseline.samples, strict=True)]
    return statistics.median(per_repeat), measured.median / baseline.median


def merge_runs(runs: Sequence[Sequence[Case]]) -> list[Case]:
    """One case per name from several runs of the same suite: the run whose ratio is the median
    of the runs' ratios (for an even count, the lower middle one), with every run's ratio, their
    median and their spread (min, max) in ``extra["runs"]``. One run on one machine is not a
    reference: a ratio is reported with the spread that repeating the whole run gives.

    >>> a = Case("x", "x", ratio=1.2); b = Case("x", "x", ratio=1.0); c = Case("x", "x", ratio=1.1)
    >>> merged = merge_runs([[a], [b], [c]])[0]
    >>> merged.ratio, merged.extra["runs"]["spread"]
    (1.1, [1.0, 1.2])
    """
    if not runs:
        return []
    merged: list[Case] = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs if i < len(run) and run[i].name == first.name]
        measured = [c for c in same if c.ratio is not None and c.skipped is None]
        if not measured:
            merged.append(first)
            continue
        ordered = sorted(measured, key=lambda c: c.ratio)  # type: ignore[arg-type,return-value]
        middle = ordered[(len(ordered) - 1) // 2]
        ratios = [c.ratio for c in measured]
        case = Case(**{**vars(middle), "extra": dict(middle.extra)})
        case.extra["runs"] = {
            "ratios": ratios,
            "median": middle.ratio,
            "spread": [min(ratios), max(ratios)],  # type: ignore[type-var]
        }
        merged.append(case)
    return merged


def machine_info() -> dict[str, Any]:
    """What the figures depend on: the machine, the software, the load when the run began."""
    try:
        load: list[float] | None = list(os.getloadavg())
    except OSError:  # pragma: no cover - platforms without getloadavg
        load = None
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15": load,
    }


def _fmt_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _fmt_target(case: Case) -> str:
    if case.target is None:
        return "-"
    if case.op == "in":
        low, high = case.target  # type: ignore[misc]
        return f"in [{low:g}, {high:g}]"
    return f"{case.op} {case.target:g}"


def format_table(cases: Sequence[Case]) -> str:
    """One row per case: measured and baseline medians (with IQR), ratio, target, verdict."""
    rows = [("case", "measured (median, IQR)", "baseline (median, IQR)", "ratio", "target", "")]
    for case in cases:
        if case.skipped is not None:
            rows.append((case.name, "skipped (below)", "", "", _fmt_target(case), ""))
            continue
        cells = []
        for label in (case.measured, case.baseline):
            s = case.stats.get(label) if label else None
            cells.append(
                "-" if s is None else f"{_fmt_seconds(s.median)} ±{_fmt_seconds(s.q3 - s.q1)}"
            )
        ratio = "-" if case.ratio is None else f"{case.ratio:.3f}"
        verdict = {True: "met", False: "MISSED", None: ""}[case.met]
        rows.append((case.name, cells[0], cells[1], ratio, _fmt_target(case), verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.extend(f"{c.name}: skipped: {c.skipped}" for c in cases if c.skipped is not None)
    return "\n".join(lines)


def write_report(
    cases: Sequence[Case],
    out: str | Path,
    *,
    suite: str,
    settings: Settings,
    seconds: float,
    runs: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Write the run's JSON to ``out`` (parents created) and return it. ``runs``: for a
    reference of several runs (``merge_runs``), what each run saw (its load when it began,
    its seconds)."""
    verdicts = [c.met for c in cases]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "suite": suite,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": {
            "repeats": settings.repeats,
            "min_block_s": settings.min_block_s,
            "warmup": settings.warmup,
            "interleaved": True,
            "ratio": "median over repeats of measured/baseline, each pair timed back to back",
            "runs": max(1, len(runs)),
        },
        "runs": list(runs),
        "wall_s": seconds,
        "summary": {
            "met": verdicts.count(True),
            "missed": verdicts.count(False),
            "info": sum(1 for c in cases if c.skipped is None and c.met is None),
            "skipped": sum(1 for c in cases if c.skipped is not None),
        },
        "cases": [c.to_json() for c in cases],
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return report
