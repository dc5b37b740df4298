"""The ``dataparallel`` command line's grammar: every subcommand's options, help and examples.

:func:`build_parser` declares ``train``, ``explain`` and ``bench``; each ``--help`` ends with
examples (every one is run by a test), and the defaults that come from a dataset or the seed
scenarios are read from the code, so the help cannot drift from it. The parser class and the
options' types are ``_usage``'s; ``cli`` parses with it and runs the command.
"""

from __future__ import annotations

import argparse
import textwrap

from dataparallel.app._usage import (
    FOLDER_MADE,
    PROG,
    Parser,
    int_at_least,
    momentum,
    path_of,
    positive_float,
    seed,
)
from dataparallel.app.demo.options import PLOT_FORMATS

__all__ = [
    "BENCH_EXAMPLES",
    "BENCH_FULL_TIME",
    "BENCH_QUICK_TIME",
    "EXPLAIN_EXAMPLES",
    "TRAIN_EXAMPLES",
    "build_parser",
]


def _wrap(text: str) -> str:
    """One paragraph, wrapped for a terminal (the raw formatter keeps line breaks as given)."""
    return textwrap.fill(text, width=79)


def _examples(*pairs: tuple[str, str]) -> str:
    """An epilog of examples: each command, then what it does (every one is run by a test)."""
    lines = ["examples:"]
    for command, what in pairs:
        lines += [f"  {command}", f"      {what}"]
    return "\n".join(lines)


_PER_DATASET_HELP = {
    "epochs": "epochs in all, counting those a resumed checkpoint holds",
    "batch_size": "global batch size, split over the devices",
    "lr": "SGD learning rate",
}
"""``train``'s options whose default comes from the dataset, and what each sets."""


def _per_dataset(field: str) -> str:
    """``"digits 20, random 1, cifar10 2"``: a default of every dataset, read from the code."""
    from dataparallel.app.demo.data import HYPER

    return ", ".join(f"{name} {getattr(hyper, field)}" for name, hyper in HYPER.items())


def _scenario_list() -> str:
    """The seed scenarios' names and titles, for ``explain --help``."""
    import torch

    from dataparallel.app.scenarios import SCENARIOS

    width = max(len(name) for name in SCENARIOS)
    lines = ["scenarios (the seed calls of the design; NAME picks some, default: all):"]
    with torch.random.fork_rng(devices=[]):  # making them draws random inputs: leave no trace
        for name, make in SCENARIOS.items():
            lines.append(f"  {name:<{width}}  {make().title}")
    return "\n".join(lines)


TRAIN_EXAMPLES = (
    ("dataparallel train --epochs 1", "one epoch on the digits, on every device"),
    (
        "dataparallel train --devices cpu,cpu --epochs 1",
        "two replicas on the CPU (for checking behaviour without a GPU, not for speed)",
    ),
    (
        "dataparallel train --data random --devices cpu,cpu,cpu --trace",
        "the tutorial's RandomDataset, printing its In Model / Outside sizes",
    ),
    (
        "dataparallel train --epochs 2 --checkpoint run.pt --json run.json --plot run.png",
        "write run.pt after every epoch, the figures as JSON and a PNG of the curves",
    ),
    (
        "dataparallel train --epochs 3 --checkpoint run.pt --resume",
        "continue run.pt from where it stopped, up to 3 epochs in all",
    ),
    (
        "dataparallel train --data cifar10:cifar-10-batches-py",
        "the real CIFAR-10: the python batches unpacked in ./cifar-10-batches-py",
    ),
    (
        "dataparallel train --strategy ddp --nproc-per-node 2 --devices cpu --data random",
        "two DDP worker processes on this machine (gloo on CPU, nccl on GPUs)",
    ),
)
EXPLAIN_EXAMPLES = (
    ("dataparallel explain", "the plan of every seed scenario"),
    ("dataparallel explain S2 S5-chunks", "two of them: a shared input, a cast with chunk sizes"),
    (
        "dataparallel explain --data digits --devices cpu,cpu",
        "how one training batch of the digits is split over two CPU replicas",
    ),
    (
        "dataparallel explain --data random --batch-size 10 --devices cpu,cpu,cpu",
        "the tutorial's last batch of 10 on three replicas (4/3/3)",
    ),
)
BENCH_QUICK_TIME = "about 30 s"
"""How long the quick set runs, measured on the project's 2-core machine (docs/benchmarks.md
says it)."""
BENCH_FULL_TIME = "about 7 minutes"
"""How long the full set (``make bench``) runs, measured there; docs/benchmarks.md says the same."""

BENCH_EXAMPLES = (
    ("dataparallel bench", f"the quick set, {BENCH_QUICK_TIME}; JSON in benchmarks/results/"),
    ("dataparallel bench --out bench.json", "the same, JSON in bench.json"),
    ("dataparallel bench --full", f"the full set, {BENCH_FULL_TIME}"),
)


def _version_line() -> str:
    """``dataparallel 0.1.0 (torch 2.13.0+cpu, Python 3.11.7)``: what a bug report needs."""
    import platform

    import torch

    from dataparallel import __version__

    return f"{PROG} {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand; each ``--help`` ends with examples."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = Parser(
        prog=PROG,
        allow_abbrev=False,  # `train --epoch 3` is refused, not read as --epochs
        description="Run one PyTorch module over many devices on one batch, and get the "
        "batch right.",
        epilog=_examples(TRAIN_EXAMPLES[0], EXPLAIN_EXAMPLES[1], BENCH_EXAMPLES[0])
        + "\n\n"
        + _wrap(
            "Each command has its own help, with more examples: dataparallel train -h, "
            "dataparallel explain -h, dataparallel bench -h."
        ),
        formatter_class=raw,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=_version_line(),
        help="print the versions of dataparallel and torch, and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="{train,explain,bench}")

    t = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train the tutorial's classifier on every device",
        description=_wrap(
            "Train the PyTorch tutorial's CIFAR-10 classifier (on scikit-learn's digits by "
            "default) with DataParallel or DDP, and report accuracy per class, throughput and "
            "the per-replica load."
        ),
        epilog=_examples(*TRAIN_EXAMPLES),
        formatter_class=raw,
    )
    t.add_argument(
        "--data",
        default="digits",
        help="digits (scikit-learn's 8x8 digits, bundled), random (the tutorial's "
        "RandomDataset) or cifar10:DIR (the official CIFAR-10 python batches in DIR) "
        "(default: %(default)s)",
    )
    # The options whose default comes from the dataset (the help names each dataset's value).
    for key, kind, metavar in (
        ("epochs", int_at_least(0), "N"),
        ("batch_size", int_at_least(1), "N"),
        ("lr", positive_float, None),
    ):
        t.add_argument(
            "--" + key.replace("_", "-"),
            type=kind,
            metavar=metavar,
            help=f"{_PER_DATASET_HELP[key]} (default per dataset: {_per_dataset(key)})",
        )
    t.add_argument(
        "--momentum", type=momentum, default=0.9, help="SGD momentum (default: %(default)s)"
    )
    t.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seed of the model's initial weights and of each epoch's order (default: %(default)s)",
    )
    t.add_argument(
        "--devices",
        default="auto",
        help='dp: a comma list such as "cpu,cpu" or "0,1" (CUDA indices); auto: every GPU, '
        "else one CPU replica; ddp: auto (one process per GPU, else the CPU) or cpu (every "
        "process on the CPU, gloo) (default: %(default)s)",
    )
    t.add_argument(
        "--strategy",
        choices=("dp", "ddp"),
        default="dp",
        help="dp: DataParallel in this process; ddp: DistributedDataParallel, one process "
        "per device (default: %(default)s)",
    )
    t.add_argument(
        "--nproc-per-node",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="ddp: worker processes to launch on this machine; 1 runs in this process "
        "(default: %(default)s)",
    )
    t.add_argument(
        "--trace",
        action="store_true",
        help="print the tutorial's In Model / Outside tensor sizes at every step (default: off)",
    )
    t.add_argument(
        "--checkpoint",
        type=path_of("run.pt"),
        metavar="PATH",
        help=f"write a checkpoint to PATH after every epoch; {FOLDER_MADE} (default: none)",
    )
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from --checkpoint PATH up to --epochs in all (default: off)",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing file at --checkpoint PATH with this new run's checkpoint; "
        "without it (or --resume) an existing file is an error (default: off)",
    )
    t.add_argument(
        "--plot",
        type=path_of("run.png"),
        metavar="PATH",
        help=f"write a plot of loss and accuracy per epoch, in the format its suffix names "
        f"({', '.join('.' + f for f in PLOT_FORMATS)}); needs matplotlib; {FOLDER_MADE} "
        f"(default: none)",
    )
    t.add_argument(
        "--json",
        type=path_of("run.json"),
        metavar="PATH",
        help=f"write the final figures as JSON; {FOLDER_MADE} (default: none)",
    )
    norm = t.add_mutually_exclusive_group()
    norm.add_argument(
        "--batchnorm",
        dest="batchnorm",
        action="store_const",
        const="chunk",
        default="none",
        help="train the net's variant with BatchNorm layers; DataParallel normalises each "
        "chunk on its own, as torch's does (default: the tutorial's net, no BatchNorm)",
    )
    norm.add_argument(
        "--sync-bn",
        dest="batchnorm",
        action="store_const",
        const="sync",
        help="the same variant with nn.SyncBatchNorm: every replica normalises with the whole "
        "batch's statistics, as one device would; under ddp, torch's process-group "
        "SyncBatchNorm (GPUs only) (default: off)",
    )
    progress = t.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show a progress bar per epoch (default: only when stderr is a terminal)",
    )
    progress.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="never show progress bars, even on a terminal (default: bars only when stderr "
        "is a terminal)",
    )

    e = sub.add_parser(
        "explain",
        allow_abbrev=False,
        help="print how batches are split",
        description=_wrap(
            "Print the plan (how each input is split, per-sample or broadcast, and why, and "
            "what each device receives) for the seed scenarios of the design, or for one "
            "training batch of --data."
        )
        + "\n\n"
        + _scenario_list(),
        epilog=_examples(*EXPLAIN_EXAMPLES),
        formatter_class=raw,
    )
    e.add_argument(
        "scenarios", nargs="*", metavar="NAME", help="scenario names, listed above (default: all)"
    )
    e.add_argument(
        "--data",
        help="explain one training batch of this dataset instead: digits, random or "
        "cifar10:DIR (default: none, the scenarios)",
    )
    e.add_argument(
        "--batch-size",
        type=int_at_least(1),
        metavar="N",
        help=f"with --data: the batch size (default: the dataset's, {_per_dataset('batch_size')})",
    )
    e.add_argument(
        "--devices",
        help='with --data: a comma list such as "cpu,cpu", or auto (default: auto, as for train)',
    )

    b = sub.add_parser(
        "bench",
        allow_abbrev=False,
        help="measure overhead and scaling against baselines (the quick set)",
        description=_wrap(
            "Run the quick benchmark set (ratios against baselines measured in the same run), "
            "print a table and write JSON. Needs a source checkout (benchmarks/)."
        ),
        epilog=_examples(*BENCH_EXAMPLES),
        formatter_class=raw,
    )
    b.add_argument(
        "--full",
        action="store_true",
        help=f"the full set, {BENCH_FULL_TIME} (default: the quick set, {BENCH_QUICK_TIME})",
    )
    b.add_argument(
        "--out",
        type=path_of("bench.json"),
        metavar="PATH",
        help=f"JSON file; {FOLDER_MADE} (default: benchmarks/results/<timestamp>.json)",
    )
    return parser
