"""The ``explain`` and ``bench`` commands: what they do once their arguments are parsed.

``train``'s work is the demo's (:func:`dataparallel.app.demo.train.run_train`); these two are
the command line's own. Each takes the parsed arguments, returns the exit code and raises
``UsageError`` for bad input, which ``cli`` turns into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["run_bench", "run_explain"]


def run_bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks`` (a folder of the source checkout, beside ``src/``).

    Args:
        args: ``bench``'s parsed arguments: ``full`` (the full set, else the quick one) and
            ``out`` (the JSON file, or ``None``).

    Returns:
        The benchmarks' exit code.
    """
    from dataparallel.app.demo.options import UsageError

    checkout = Path(__file__).resolve().parents[3]
    if not (checkout / "benchmarks" / "__main__.py").is_file():
        raise UsageError(
            "bench: expected the benchmarks/ folder of a source checkout beside the package, "
            "got an installed package without it (the benchmarks do not ship); fix: clone the "
            "repository and run `make bench` there"
        )
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from benchmarks.__main__ import main as bench_main

    argv = [] if args.full else ["--quick"]
    if args.out:
        from dataparallel.app.demo.options import check_output_path

        check_output_path("bench --out", args.out)
        argv += ["--out", args.out]
    return bench_main(argv)


def run_explain(args: argparse.Namespace, out: TextIO) -> int:
    """Print the plans of the seed scenarios named in ``args``, or of one training batch of
    ``args.data``.

    Args:
        args: ``explain``'s parsed arguments: ``scenarios``, ``data``, ``batch_size``,
            ``devices``.
        out: where the plans are printed.

    Returns:
        0.
    """
    from dataparallel.app.demo.options import UsageError
    from dataparallel.app.demo.train import parse_devices
    from dataparallel.plan import plan

    if args.data is None:
        given = [
            (flag, value)
            for flag, value in (("--devices", args.devices), ("--batch-size", args.batch_size))
            if value is not None
        ]
        if given:
            flag, value = given[0]
            raise UsageError(
                f"explain: {flag} applies to --data (one training batch of a dataset), got "
                f"{flag} {str(value)!r} without --data (the scenarios run on their own "
                f"devices); add --data digits, or drop {flag}"
            )
    else:
        from dataparallel.app.demo.data import DataError, load_dataset

        try:
            data = load_dataset(args.data)
        except DataError as exc:
            raise UsageError(str(exc)) from exc
        devices = parse_devices(args.devices or "auto")
        batch = data.train_x[: args.batch_size or data.batch_size]
        where = ", ".join(str(d) for d in devices)
        print(f"{data.name}: one training batch of {len(batch)} on {where}", file=out)
        print(str(plan((batch,), {}, devices)), file=out)
        return 0
    from dataparallel.app.scenarios import SCENARIOS

    names = list(args.scenarios) or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise UsageError(
            f"explain: expected scenario names from {', '.join(SCENARIOS)}, got {unknown[0]!r}"
        )
    for i, name in enumerate(names):
        made = SCENARIOS[name]()
        if isinstance(made, tuple):  # (inputs, kwargs, devices)
            inputs, kwargs, devices = made
            title, opts = "", {}
        else:
            inputs, kwargs, devices = made.inputs, made.kwargs, made.devices
            title, opts = getattr(made, "title", ""), dict(getattr(made, "opts", {}) or {})
        if i:
            print(file=out)
        print(f"{name}: {title}" if title else name, file=out)
        expect = getattr(made, "expect", "")
        if expect:
            print(f"expected: {expect}", file=out)
        print(str(plan(inputs, kwargs, devices, **opts)), file=out)
    return 0
