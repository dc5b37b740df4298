"""``python -m benchmarks.bench_loss_terms [--out FILE]``: the cost of gathering a loss from how
forward built it (issue 59), on two CPU replicas.

Two training steps, each timed as the median of blocks of calls after a warm-up: the tutorial
CNN (batch 32, its cross-entropy outside the wrapper: a call of floats alone, nothing marked)
and GPT-2 with 4 layers (batch 8 of 64 tokens, forward and backward with ``labels``: its loss
built inside forward from the marked labels). The issue's bound is 3% over the same steps on
the code before it: run this file against both trees in turn (``PYTHONPATH``), interleaved, and
compare the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import dataparallel as dp
from dataparallel.app.demo.models import Net

__all__ = ["main", "measure"]


def _cnn() -> Callable[[], None]:
    torch.manual_seed(0)
    module = Net(3, 32, 10)
    wrapped = dp.DataParallel(module, ["cpu", "cpu"])
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()

    return step


def _gpt2() -> Callable[[], None]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=1024,
        n_positions=64,
        n_embd=128,
        n_layer=4,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    module = transformers.GPT2LMHeadModel(config)
    wrapped = dp.DataParallel(module, ["cpu", "cpu"])
    ids = torch.randint(0, 1024, (8, 64))
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        wrapped(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return step


CASES: dict[str, Callable[[], Callable[[], None]]] = {"cnn_train_2x": _cnn, "gpt2_train_2x": _gpt2}


def measure(name: str, blocks: int = 15, calls: int = 5, warmup: int = 5) -> dict[str, Any]:
    """The median, min and max seconds per step of case ``name`` over ``blocks`` blocks."""
    step = CASES[name]()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - start) / calls)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file (default: print)")
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found = {name: measure(name) for name in args.case or CASES}
    text = json.dumps({"torch": torch.__version__, "cases": found}, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
