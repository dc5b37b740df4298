"""The product's own DDP path against a raw torch DDP loop of the same work: samples per second.

``ours`` is the command a user runs, ``dataparallel train --strategy ddp --nproc-per-node 2
--devices cpu --data random --epochs E --no-progress --json F`` (its launcher, its workers,
its loop); its figure is the ``samples_per_second`` of that JSON: samples over the time of
the training loops alone, on rank 0. ``raw`` is ``benchmarks/raw_ddp.py`` under
``torchrun --standalone --nproc-per-node 2``: the same data, network, optimizer and global
batch, in torch's tutorial loop, timed the same way. Both run with ``OMP_NUM_THREADS=1``
(one intra-op thread per process, as the CLI's launcher sets it).

Each round runs both, the order rotating from round to round, so that a slow spell of the
machine (other users) hits both sides; the ratio is the median over rounds of ``ours / raw``
within a round, the target >= 0.95. The 1-minute load average is read before every run and
kept beside the figures, since on a shared 2-core machine it is what moves them.

    python benchmarks/bench_train_ddp.py --out benchmarks/results/ddp-train.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["TARGET", "command", "main", "run_rounds"]

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.95
WAYS = ("ours", "raw")


def command(way: str, epochs: int, nproc: int, out: Path) -> list[str]:
    """The command line of one side, writing its figures to ``out``."""
    if way == "ours":
        return [
            sys.executable,
            "-m",
            "dataparallel",
            "train",
            "--strategy",
            "ddp",
            "--nproc-per-node",
            str(nproc),
            "--devices",
            "cpu",  # raw_ddp.py runs gloo on the CPU: the same device on a GPU machine too
            "--data",
            "random",
            "--epochs",
            str(epochs),
            "--no-progress",
            "--json",
            str(out),
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(ROOT / "benchmarks" / "raw_ddp.py"),
        "--epochs",
        str(epochs),
        "--out",
        str(out),
    ]


def _load() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _run_one(way: str, epochs: int, nproc: int, tmp: Path, timeout: float) -> dict[str, Any]:
    out = tmp / f"{way}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failures: list[str] = []
    # One retry: a launch can fail for reasons of the machine (a port taken between its choice
    # and its use); the failure is kept in the report, and a second one ends the benchmark.
    for _attempt in range(2):
        out.unlink(missing_ok=True)
        load = _load()
        start = time.perf_counter()
        proc = subprocess.run(
            command(way, epochs, nproc, out),
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        wall = time.perf_counter() - start
        if proc.returncode == 0 and out.exists():
            rate = float(json.loads(out.read_text())["samples_per_second"])
            return {"samples_per_s": rate, "wall_s": wall, "load_before": load, "failed": failures}
        failures.append(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    raise RuntimeError(f"{way}: expected exit 0 and {out.name}, got {failures[-1]}")


def run_rounds(
    rounds: int, epochs: int, nproc: int = 2, timeout: float = 120.0, echo: bool = True
) -> dict[str, Any]:
    """Run ``rounds`` rotating rounds of both sides; the report (see the module's docstring).

    Raises:
        RuntimeError: a side failed (its exit code and the end of its output are in the text).
        subprocess.TimeoutExpired: a side ran past ``timeout`` seconds.
    """
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = WAYS if r % 2 == 0 else WAYS[::-1]
            for way in order:
                result = _run_one(way, epochs, nproc, Path(tmp), timeout)
                runs[way].append(result)
                if echo:
                    print(
                        f"round {r + 1}/{rounds} {way:>4}: {result['samples_per_s']:,.0f} "
                        f"samples/s (load {result['load_before']})",
                        flush=True,
                    )
    rates = {way: [r["samples_per_s"] for r in runs[way]] for way in WAYS}
    ratios = [o / b for o, b in zip(rates["ours"], rates["raw"], strict=True)]
    loads = [r["load_before"] for way in WAYS for r in runs[way] if r["load_before"] is not None]
    ratio = statistics.median(ratios)
    return {
        "benchmark": "train_ddp",
        "config": {
            "ours": " ".join(command("ours", epochs, nproc, Path("F"))[1:]),
            "raw": "torchrun --standalone benchmarks/raw_ddp.py",
            "processes": nproc,
            "backend": "gloo",
            "data": "random",
            "epochs": epochs,
            "rounds": rounds,
            "omp_num_threads": 1,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": _torch_version(),
        },
        "samples_per_s_median": {way: statistics.median(rates[way]) for way in WAYS},
        "ratio": ratio,
        "ratios": ratios,
        "ratio_of_medians": statistics.median(rates["ours"]) / statistics.median(rates["raw"]),
        "target_ratio": TARGET,
        "met": ratio >= TARGET,
        "load_average_1min": {
            "median": round(statistics.median(loads), 2) if loads else None,
            "max": max(loads) if loads else None,
        },
        "seconds": time.perf_counter() - started,
        "runs": runs,
    }


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, write the JSON, print the summary; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/ddp-train.json")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    for flag, value in (("--rounds", args.rounds), ("--epochs", args.epochs)):
        if value < 1:
            parser.error(f"{flag}: expected an integer >= 1, got {value}")
    report = run_rounds(args.rounds, args.epochs, args.nproc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    med = report["samples_per_s_median"]
    print(
        f"ours {med['ours']:,.0f} samples/s, raw {med['raw']:,.0f} samples/s, ratio "
        f"{report['ratio']:.3f} (target >= {TARGET}, {'met' if report['met'] else 'missed'}), "
        f"load average {report['load_average_1min']['median']} (median); wrote {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
