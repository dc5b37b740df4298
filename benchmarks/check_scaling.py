"""What a cached two-replica call costs per module, at 151, 751 and 2,251 modules.

A warm call checks that nothing the replicas copied was written since the last call
(``replicate._check.Snapshot.same``): its cost grows with the module tree. Where the
interpreter has write stamps (CPython 3.11, ``_common.stamps``) one read answers for every
table; elsewhere every identity is compared. ``python -m benchmarks.check_scaling`` prints the
rows; ``case_check_scaling`` (part of the full set) turns them into cases.

Each size is the replicas a ``DataParallel`` wrapper keeps (``ReplicaSets.replicate``, two
CPU replicas, inference) against a fresh build of the same replicas, timed side by side. The
slope, (cost at 2,251 - cost at 151) / 2,100, is the cost of one more module: issue 52's target
is 0.5 µs or less without stamps. The snapshot's full comparison is also timed alone, with the
stamps bypassed, so a 3.11 run shows what 3.12 and 3.13 pay; and the staleness check a warm
call makes, alone (``Snapshot.same`` and ``Rebinding.same``, with the stamps where the
interpreter has them): its cost per module is issue 60's figure, recorded per Python version
(``--out FILE`` writes the rows as JSON, with the interpreter's version).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Case, Settings, Stats, compare, paired_ratio
from dataparallel._common import stamps
from dataparallel.replicate import ReplicaSets, fresh_replicate
from dataparallel.replicate._check import Snapshot, fingerprint

__all__ = ["SIZES", "SLOPE_TARGET_US", "case_check_scaling", "main", "many_module_net"]

SIZES = (151, 751, 2251)  # modules: 5 per block (a Sequential of four) plus the root
SLOPE_TARGET_US = 0.5  # issue 52: a module's share of a cached call without stamps
CPU2 = ["cpu", "cpu"]


def many_module_net(blocks: int = 50) -> torch.nn.Module:
    """A module of ``5 * blocks + 1`` submodules (251 by default): a Sequential of Linear,
    BatchNorm, ReLU and Dropout per block, the mix of modules with and without tensors that
    real models have."""
    nn = torch.nn
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1))
            for _ in range(blocks)
        ]
    )


def _full_comparison(snapshot: Snapshot) -> bool:
    """The snapshot's check as a Python without write stamps makes it: every identity."""
    saved = snapshot._stamps
    snapshot._stamps, snapshot._stampable = None, False
    try:
        return snapshot.same()
    finally:
        snapshot._stamps, snapshot._stampable = saved, True


def case_check_scaling(settings: Settings) -> list[Case]:
    """One case per size (cached call against a fresh build, and the full comparison alone),
    then the slope against its target."""
    cases: list[Case] = []
    cached_stats: dict[int, Stats] = {}
    compared_stats: dict[int, Stats] = {}
    checked_stats: dict[int, Stats] = {}
    for modules in SIZES:
        net = many_module_net((modules - 1) // 5).eval()
        sets = ReplicaSets()
        with torch.no_grad():
            sets.replicate(net, CPU2)
            sets.replicate(net, CPU2)  # the snapshot taken, its stamps made
        entry = next(iter(sets.sets.values()))
        snapshot = entry.snapshot
        if snapshot is None or not _full_comparison(snapshot):
            raise RuntimeError("the replicas were not kept, or the tree changed")

        def cached(n: torch.nn.Module = net, s: ReplicaSets = sets) -> object:
            with torch.no_grad():
                return s.replicate(n, CPU2)

        def fresh(n: torch.nn.Module = net) -> object:
            with torch.no_grad():
                return fresh_replicate(n, CPU2)

        def compared(s: Snapshot = snapshot) -> object:
            return _full_comparison(s)

        def checked(s: Snapshot = snapshot, r: Any = entry.rebinding) -> object:
            return s.same() and r.same()  # what ``current_replicas`` asks first

        stats = compare(
            {"cached": cached, "fresh": fresh, "full comparison": compared, "check": checked},
            settings,
        )
        cached_stats[modules], compared_stats[modules] = stats["cached"], stats["full comparison"]
        checked_stats[modules] = stats["check"]
        ratio, of_medians = paired_ratio(stats["cached"], stats["fresh"])
        count = len(fingerprint(net)[0])
        cases.append(
            Case(
                f"check_{modules}_modules",
                f"cached replicate of a {count}-module net onto {CPU2}, inference, "
                "vs a fresh build",
                "fresh",
                "cached",
                stats,
                ratio,
                of_medians,
                "cached time / fresh_replicate time",
                "<=",
                None,
                extra={
                    "modules": count,
                    "stamps": stamps.AVAILABLE,
                    "cached_us_per_module": stats["cached"].median / count * 1e6,
                    "full_comparison_us_per_module": stats["full comparison"].median / count * 1e6,
                    "check_us_per_module": stats["check"].median / count * 1e6,
                },
            )
        )
    low, high = SIZES[0], SIZES[-1]
    span = high - low

    def slope(of: dict[int, Stats]) -> float:
        return (of[high].median - of[low].median) / span * 1e6

    cases.append(
        Case(
            "check_slope",
            f"a cached two-replica call's cost per module ({low} to {high} modules; "
            f"write stamps {'on' if stamps.AVAILABLE else 'absent'})",
            None,
            "cached",
            {"cached": cached_stats[high], "full comparison": compared_stats[high]},
            slope(cached_stats),
            slope(cached_stats),
            "µs per module: (cached call at 2,251 - at 151) / 2,100",
            "<=",
            SLOPE_TARGET_US,
            extra={
                "stamps": stamps.AVAILABLE,
                "full_comparison_slope_us": slope(compared_stats),
                "check_slope_us": slope(checked_stats),
                "cached_us": {str(k): v.median * 1e6 for k, v in cached_stats.items()},
                "full_comparison_us": {str(k): v.median * 1e6 for k, v in compared_stats.items()},
                "check_us": {str(k): v.median * 1e6 for k, v in checked_stats.items()},
            },
        )
    )
    return cases


def main(argv: list[str] | None = None) -> None:
    """Print the rows as JSON lines; ``--out FILE``: write them to ``FILE`` too, as one JSON
    document with the interpreter's version."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for case in case_check_scaling(Settings(repeats=args.repeats, min_block_s=0.04)):
        row: dict[str, Any] = {"name": case.name, "ratio": case.ratio, **case.extra}
        rows.append(row)
        print(json.dumps(row))
    if args.out is not None:
        report = {
            "benchmark": "check_scaling",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "stamps": stamps.AVAILABLE,
            "rows": rows,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
