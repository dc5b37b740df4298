"""GPU benchmarks, for a machine with CUDA: each figure beside its baseline, in the same run.

- host-to-device scatter bandwidth from pinned memory against a raw pinned ``copy_`` of the
  same bytes into a preallocated tensor (target >= 0.9 of the raw bandwidth);
- a training step of the tutorial CNN with ``DataParallel`` on ``[0]`` and ``[0, 0]`` against
  the plain module on GPU 0 and against ``torch.nn.DataParallel`` on the same devices;
- ``dataparallel.replicate`` (cached) against ``torch.nn.parallel.replicate``.

Every timed call ends with ``torch.cuda.synchronize()``, so a figure is the time to a finished
result. Without CUDA the script says so and exits 0.

    python benchmarks/bench_gpu.py [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import Case, Settings, compare, format_table, paired_ratio, write_report

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results"


def _synced(fn: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        fn()
        torch.cuda.synchronize()

    return call


def _pair(name: str, title: str, stats: Any, measured: str, baseline: str, **kw: Any) -> Case:
    ratio, of_medians = paired_ratio(stats[measured], stats[baseline])
    return Case(name, title, baseline, measured, stats, ratio, of_medians, kw.pop("what"), **kw)


def case_h2d(settings: Settings) -> list[Case]:
    """Pinned host-to-device scatter bandwidth, as a fraction of a raw pinned ``copy_``."""
    from dataparallel.scatter import scatter

    host = torch.randn(64, 3, 224, 224).pin_memory()  # 38.5 MB
    nbytes = host.numel() * host.element_size()
    dest = torch.empty_like(host, device="cuda:0")
    cases = []
    for devices in ([0], [0, 0]):
        stats = compare(
            {
                "scatter": _synced(functools.partial(scatter, host, devices)),
                "raw copy_": _synced(lambda: dest.copy_(host, non_blocking=True)),
            },
            settings,
        )
        ratio, of_medians = paired_ratio(stats["raw copy_"], stats["scatter"])  # bandwidth
        cases.append(
            Case(
                f"h2d_scatter_{len(devices)}x",
                f"scatter of a pinned {nbytes / 1e6:.1f} MB batch onto {devices} vs a raw "
                "pinned copy_ of the same bytes",
                "raw copy_",
                "scatter",
                stats,
                ratio,
                of_medians,
                "scatter bandwidth / raw copy_ bandwidth",
                ">=",
                0.9,
                extra={
                    "bytes": nbytes,
                    "scatter_GB_per_s": nbytes / stats["scatter"].median / 1e9,
                    "raw_GB_per_s": nbytes / stats["raw copy_"].median / 1e9,
                },
            )
        )
    pageable = host.clone()  # the same bytes in ordinary (pageable) host memory
    stats = compare(
        {
            "pinned": _synced(functools.partial(scatter, host, [0, 0])),
            "pageable": _synced(functools.partial(scatter, pageable, [0, 0])),
        },
        settings,
    )
    cases.append(
        _pair(
            "h2d_scatter_pinned_vs_pageable",
            f"scatter of a {nbytes / 1e6:.1f} MB batch onto [0, 0]: pinned source (non-blocking "
            "copies on side streams) vs the same batch in pageable memory (plain copies)",
            stats,
            "pinned",
            "pageable",
            what="pinned scatter time / pageable scatter time",
        )
    )
    return cases


def _stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()

    return step


def case_train_step(settings: Settings) -> list[Case]:
    """DataParallel on [0] and [0, 0] vs the plain module and torch.nn.DataParallel."""
    from dataparallel.app.demo.models import Net
    from dataparallel.wrapper import DataParallel

    torch.manual_seed(0)
    base = Net(3, 32, 10).cuda()
    x = torch.randn(128, 3, 32, 32, device="cuda:0")
    y = torch.randint(0, 10, (128,), device="cuda:0")
    cases = []
    for devices in ([0], [0, 0]):
        contenders = {
            "ours": _stepper(DataParallel(copy.deepcopy(base), devices), x, y),
            "plain": _stepper(copy.deepcopy(base), x, y),
        }
        torch_note = None
        try:
            theirs = nn.DataParallel(copy.deepcopy(base), devices)
            _stepper(theirs, x, y)()
            contenders["torch DataParallel"] = _stepper(theirs, x, y)
        except Exception as exc:
            torch_note = f"torch.nn.DataParallel({devices}) failed: {type(exc).__name__}: {exc}"
        stats = compare(contenders, settings)
        tag = "x".join(map(str, devices))
        cases.append(
            _pair(
                f"dp_{tag}_vs_plain",
                f"training step, Net(3, 32, 10), batch 128: "
                f"DataParallel(net, {devices}) vs the plain module on cuda:0",
                stats,
                "ours",
                "plain",
                what="step time / plain step time",
                target=1.03 if devices == [0] else None,
            )
        )
        if torch_note is None:
            cases.append(
                _pair(
                    f"dp_{tag}_vs_torch",
                    f"training step, batch 128: DataParallel(net, "
                    f"{devices}) vs torch.nn.DataParallel(net, {devices})",
                    stats,
                    "ours",
                    "torch DataParallel",
                    target=1.0,
                    what="our step time / torch's step time",
                )
            )
        else:
            cases.append(Case(f"dp_{tag}_vs_torch", "vs torch.nn.DataParallel", skipped=torch_note))
    return cases


def case_replicate(settings: Settings) -> list[Case]:
    """Our cached replicate vs torch.nn.parallel.replicate, inference and training."""
    from torch.nn.parallel import replicate as torch_replicate

    from benchmarks.cases import many_module_net
    from dataparallel.replicate import fresh_replicate, replicate

    net = many_module_net().cuda()
    count = torch.cuda.device_count()
    devices = list(range(count)) if count > 1 else [0, 0]
    cases = []
    for mode, grad in (("inference", False), ("training", True)):

        def ours(g: bool = grad) -> None:
            with torch.set_grad_enabled(g):
                replicate(net, devices)
            torch.cuda.synchronize()

        def theirs(g: bool = grad) -> None:
            with torch.set_grad_enabled(g):
                torch_replicate(net, devices, detach=not g)
            torch.cuda.synchronize()

        try:
            theirs()
        except Exception as exc:
            cases.append(
                Case(
                    f"replicate_{mode}_vs_torch",
                    f"replicate onto {devices}",
                    skipped=f"torch.nn.parallel.replicate({devices}) failed: {exc}",
                )
            )
            continue

        def fresh(g: bool = grad) -> None:
            with torch.set_grad_enabled(g):
                fresh_replicate(net, devices)
            torch.cuda.synchronize()

        stats = compare({"ours": ours, "fresh": fresh, "torch": theirs}, settings)
        cases.append(
            _pair(
                f"replicate_{mode}_cached_vs_fresh",
                f"replicate of a 251-module net onto {devices}, {mode}: cached vs fresh_replicate",
                stats,
                "ours",
                "fresh",
                target=None,
                what="cached time / fresh time",
            )
        )
        cases.append(
            _pair(
                f"replicate_{mode}_vs_torch",
                f"replicate of a 251-module net onto {devices}, {mode}: ours (cached) vs "
                "torch.nn.parallel.replicate",
                stats,
                "ours",
                "torch",
                target=None,
                what="our time / torch's time",
            )
        )
    return cases


def main(argv: list[str] | None = None) -> int:
    """Run the GPU set (or say why not), write JSON, print the table; returns the status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file (default: benchmarks/results/gpu-<time>.json)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repeats")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    settings = (
        Settings(repeats=7, min_block_s=0.03, warmup=2)
        if args.quick
        else Settings(repeats=15, min_block_s=0.1, warmup=3)
    )
    start = time.perf_counter()
    cases: list[Case] = []
    for fn in (case_h2d, case_train_step, case_replicate):
        print(f"running {fn.__name__} ...", flush=True)
        cases.extend(fn(settings))
    out = Path(args.out) if args.out else RESULTS / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = write_report(
        cases, out, suite="gpu", settings=settings, seconds=time.perf_counter() - start
    )
    report_machine = report["machine"]
    print(format_table(cases))
    print(f"{torch.cuda.get_device_name(0)}, torch {report_machine['torch']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
