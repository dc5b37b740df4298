"""``python -m benchmarks.bench_replica_memory [--out FILE]``: the peak memory a wrapped call
adds for a frozen backbone and a LoRA base on CPU replicas that share the module (issue 60,
item 4).

Each case runs in a fresh process: the module is built and run once plainly (its memory and one
plain call's activations), then its peak resident set is read; then the wrapper runs three
training calls and three inference calls, and the peak is read again. The difference is what
the replicas cost beyond one device's call, in MiB, against the size of the frozen weights
(before issue 60: one copy of every frozen parameter per extra replica at the first call in
each mode). Peak RSS (``ru_maxrss``) is what the operating system saw, allocator included.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "measure"]

_SIZE = 3072  # a 3072 x 3072 float32 backbone weight: 36 MiB


def measure(case: str, replicas: int) -> dict[str, Any]:
    """One case in this process: the peak memory the wrapped calls add, in MiB."""
    import torch
    from torch import nn

    import dataparallel as dp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = nn.Linear(_SIZE, _SIZE).requires_grad_(False)
    if case == "frozen_backbone":
        model: nn.Module = nn.Sequential(base, nn.ReLU(), nn.Linear(_SIZE, 4))
    else:  # a LoRA base: the frozen weight plus a trainable low-rank update

        class Lora(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.base = base
                self.a = nn.Parameter(torch.randn(8, _SIZE) * 0.01)
                self.b = nn.Parameter(torch.zeros(_SIZE, 8))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.base(x) + x @ self.a.t() @ self.b.t()

        model = Lora()
    x = torch.randn(8, _SIZE)
    model(x).sum().backward()  # one device's call, activations and gradients included
    frozen_mib = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    wrapper = dp.DataParallel(model, ["cpu"] * replicas)
    for training in (True, False):
        model.train(training)
        for _ in range(3):
            if training:
                wrapper(x).sum().backward()
            else:
                with torch.no_grad():
                    wrapper(x)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "case": case,
        "replicas": replicas,
        "frozen_mib": round(frozen_mib, 1),
        "added_peak_mib": round(after - before, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every case in its own process; write the JSON report and print it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("CASE", "REPLICAS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        result = measure(args.one[0], int(args.one[1]))
        print(json.dumps(result))
        return result
    rows = []
    for case in ("frozen_backbone", "lora_base"):
        for replicas in (2, 3):
            command = [sys.executable, "-m", "benchmarks.bench_replica_memory"]
            done = subprocess.run(
                [*command, "--one", case, str(replicas)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {"benchmark": "replica_memory", "unit": "MiB", "rows": rows}
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
