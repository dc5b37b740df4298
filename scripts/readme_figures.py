"""Write the README's measured figures from committed results, never by hand.

``python scripts/readme_figures.py [--run] [--check]`` (``make readme-figures`` runs it with
``--run``):

- ``--run`` first measures: the default ``dataparallel train`` (what ``make train`` runs) and the
  same on two CPU replicas, each writing its ``--json`` into ``benchmarks/results/`` with the
  machine it ran on;
- then it rewrites the README's marked regions (``<!-- figures:NAME -->`` ...
  ``<!-- /figures:NAME -->``) from ``benchmarks/results/train-default.json``,
  ``train-2cpu.json`` and ``latest-cpu.json``;
- ``--check`` rewrites nothing and exits 1 when a region differs from what the results say
  (``tests/test_readme_figures.py`` does the same check).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
TRAIN_DEFAULT = RESULTS / "train-default.json"
TRAIN_2CPU = RESULTS / "train-2cpu.json"
BENCH = RESULTS / "latest-cpu.json"

__all__ = ["machine", "main", "regions", "render", "rendered_readme"]

# The README's words for each benchmark case: (what is measured, what the baseline is).
CASE_TEXT = {
    "scatter_gather_hetero": (
        "scatter + gather of a mixed batch of 256 (images, 256 boxes, 256 strings, a shared "
        "tensor, a dict), 2 CPU devices",
        "hand-written split/cat",
    ),
    "plan_scaling": (
        "`plan` of 10,000 leaves against 1,000 (linear means about 10)",
        "1,000 leaves",
    ),
    "dp_one_replica_train_step": (
        '`DataParallel(net, ["cpu"])` training step of the tutorial CNN, batch 32',
        "the plain module",
    ),
    "replicate_2x_inference": (
        "cached `replicate`, 251-module net, 2 replicas, inference",
        "fresh replicas",
    ),
    "replicate_2x_training": ("the same, training", "fresh replicas"),
    "replicate_2x_training_copy": (
        'the same, training on `["cpu", "cpu:1"]` (differentiable parameter copies)',
        "fresh replicas",
    ),
    "replicate_4x_training_copy": ("the same on 4 devices `cpu`, `cpu:1`..", "fresh replicas"),
    "replicate_2x_neighbour_writes": (
        "cached `replicate`, 2 replicas, inference, each call after a write to a module outside "
        "the tree",
        "fresh replicas",
    ),
    "replicate_2x_one_module_written": (
        "the same, each call after a write to one module of the tree (its replicas refilled)",
        "fresh replicas",
    ),
    "replicate_2x_miss": (
        "`replicate` after `clear_replica_cache` (a cache miss), 2 replicas",
        "fresh replicas",
    ),
    "replicate_4x_inference": ("cached `replicate`, 4 replicas, inference", "fresh replicas"),
    "replicate_4x_training": ("the same, training", "fresh replicas"),
    "ddp_path": (
        "our DDP path (`ddp_session` + `ShardedSampler`), 2 gloo processes, time per 1,000 samples",
        "plain torch DDP loop",
    ),
}


def machine() -> dict[str, Any]:
    """What a training figure depends on: the CPU, the threads and torch."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _run_train(out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "dataparallel", "train", "--no-progress", "--json", str(out)]
    subprocess.run([*cmd, *extra], check=True, cwd=ROOT)
    figures = json.loads(out.read_text())
    figures["machine"] = machine()
    figures["command"] = " ".join(["dataparallel", "train", *extra]).strip()
    out.write_text(json.dumps(figures, indent=2) + "\n")


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _sample_output(train: dict[str, Any]) -> str:
    from dataparallel.demo.options import EpochStats, TrainResult
    from dataparallel.demo.report import format_report

    result = TrainResult(
        data=train["data"],
        strategy=train["strategy"],
        devices=train["devices"],
        epochs=train["epochs"],
        batch_size=train["batch_size"],
        history=[EpochStats(**h) for h in train["history"]],
        test_accuracy=train["test_accuracy"],
        per_class=[(k, v["correct"], v["total"]) for k, v in train["per_class"].items()],
        samples_per_second=train["samples_per_second"],
        wall_seconds=train["wall_seconds"],
        last_step=train["last_step"],
        last_call=train["last_call"],
    )
    lines = format_report(result).splitlines()
    # The first two classes, "...", the last one: the whole table is in the JSON.
    classes = len(result.per_class)
    shown = [*lines[:4], "...", lines[1 + classes], *lines[2 + classes :]]
    m = train["machine"]
    return "\n".join(
        [
            "```",
            *shown,
            "```",
            "",
            *_wrap(
                f"(`{train['command']}` on {m['cpus']} CPUs ({m['cpu']}, torch {m['torch']}, "
                f"{m['torch_threads']} threads): {len(result.history)} epochs in "
                f"{sum(h.seconds for h in result.history):.1f} s of training, the same "
                f"accuracy on every run there. Another CPU or thread count rounds differently "
                f"and can end a few test images apart; the throughput moves with the machine's "
                f"load.)"
            ),
        ]
    )


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, width=100, break_on_hyphens=False, break_long_words=False)


def _cpu_replicas(one: dict[str, Any], two: dict[str, Any]) -> str:
    rate1, rate2 = one["samples_per_second"], two["samples_per_second"]
    verdict = (
        f"on {two['machine']['cpus']} cores the replicas' threads oversubscribe the CPU"
        if rate2 < rate1
        else "the second replica paid for itself on this run"
    )
    return "\n".join(
        _wrap(
            f"On a CPU, `--devices auto` uses one replica: measured here, one replica trains "
            f"the digits net at {rate1:,.0f} samples/s and two (`--devices cpu,cpu`) at "
            f"{rate2:,.0f} (batch {two['batch_size']}, load average "
            f"{two['machine']['load_average_1min']} while measured): {verdict}."
        )
    )


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _target(target: dict[str, Any] | None) -> str:
    if target is None:
        return ""
    if target["op"] == "in":
        low, high = target["value"]
        return f"{low}–{high}"
    return f"{target['op']} {target['value']}"


_MODELS = {"mlp": "tiny MLP, batch 64", "cnn": "tutorial CNN, batch 32"}


def _case_text(case: dict[str, Any]) -> tuple[str, str]:
    """The README's words for a case: fixed ones, or built for the end-to-end cases."""
    name = case["name"]
    if name in CASE_TEXT:
        return CASE_TEXT[name]
    extra = case.get("extra", {})
    if name.startswith("e2e_") and "replicas" in extra:
        n = extra["replicas"]
        return (
            f"`DataParallel`, {n} CPU replica{'s' * (n > 1)}, {_MODELS[extra['model']]}, "
            f"{extra['mode']} (x{extra['ratio_to_plain']:.2f} the plain module, "
            f"+{extra['overhead_us']:.0f} µs)",
            "hand-written floor",
        )
    if name.startswith("e2e_") and name.endswith("_overhead_us"):
        mode = name.split("_")[2]
        return (f"µs of ours beyond the floor per call, tiny MLP, 2 replicas, {mode}", "floor")
    if name.startswith("e2e_") and name.endswith("_per_replica_us"):
        mode = name.split("_")[2]
        return (f"µs more per further replica (2 to 8), tiny MLP, {mode}", "floor")
    return case["title"], case["baseline"]


def _bench_table(bench: dict[str, Any]) -> str:
    rows = [
        "| case | measured | baseline | ratio | target | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in bench["cases"]:
        if case["status"] != "ok":
            continue
        what, base = _case_text(case)
        measured = case["stats"][case["measured"]]["median_s"]
        baseline = case["stats"][case["baseline"]]["median_s"]
        verdict = {True: "met", False: "**missed**", None: ""}[case["met"]]
        rows.append(
            f"| {what} | {_fmt_time(measured)} | {_fmt_time(baseline)} ({base}) | "
            f"{case['ratio']:.3f} | {_target(case['target'])} | {verdict} |"
        )
    return "\n".join(rows)


def render() -> dict[str, str]:
    """Each README region's text, from the committed results."""
    one, two, bench = _load(TRAIN_DEFAULT), _load(TRAIN_2CPU), _load(BENCH)
    return {
        "train-output": _sample_output(one),
        "cpu-replicas": _cpu_replicas(one, two),
        "bench-table": _bench_table(bench),
    }


_REGION = re.compile(
    r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(\n<!-- /figures:(?P=name) -->)", re.S
)


def regions(text: str) -> dict[str, str]:
    """The README's marked regions, by name."""
    return {m["name"]: m["body"] for m in _REGION.finditer(text)}


def rendered_readme(text: str) -> str:
    """``text`` with every marked region rewritten from the results.

    Raises:
        ValueError: a region the results fill is missing from ``text``.
    """
    fresh = render()
    missing = sorted(set(fresh) - set(regions(text)))
    if missing:
        raise ValueError(f"README.md: expected the regions {missing}, got none marked")
    return _REGION.sub(lambda m: m[1] + fresh[m["name"]] + m[4], text)


def main(argv: list[str] | None = None) -> int:
    """Measure (``--run``), then write or ``--check`` the README's figures."""
    parser = argparse.ArgumentParser(prog="scripts/readme_figures.py", description=__doc__)
    parser.add_argument("--run", action="store_true", help="run the trainings first")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 on a change")
    args = parser.parse_args(argv)
    if args.run:
        _run_train(TRAIN_DEFAULT)
        _run_train(TRAIN_2CPU, "--devices", "cpu,cpu")
    text = README.read_text(encoding="utf-8")
    new = rendered_readme(text)
    if args.check:
        if new != text:
            print("README.md: figures differ from benchmarks/results; run make readme-figures")
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
