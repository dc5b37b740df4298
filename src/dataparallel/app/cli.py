"""The ``dataparallel`` command line: ``train``, ``explain`` and ``bench``.

This module is the entry point (the console script and ``python -m dataparallel``): it parses
arguments (the parser is ``_parser``'s), hands the command to its implementation
(:mod:`dataparallel.app.demo.train` for ``train``, ``_commands`` for ``explain`` and ``bench``)
and turns every way a run can end into one line on stderr and a conventional exit code. Exit
codes: 0 done; 2 bad usage or input (``dataparallel: error: ...``, found before the first
epoch); 3 training stopped (the loss was no longer finite, or the disk could not hold a
checkpoint); 130 interrupted (Ctrl-C, to the launcher or one worker; the last complete checkpoint
is kept); 5 (a ddp worker) a collective waited past its limit: the line names
the ranks that stopped answering; 141 the reader of the output went away (``... | head``), ending
quietly as a command killed by ``SIGPIPE`` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

from dataparallel.app._commands import run_bench, run_explain
from dataparallel.app._parser import build_parser
from dataparallel.app._usage import PROG, UsageParseError

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module's docstring).

    Args:
        argv: the arguments after the program name; ``None`` reads ``sys.argv``.
    """
    from dataparallel.app.launch import PEER_GONE_EXIT, peer_gone, watch_launcher

    # A worker of `--strategy ddp --nproc-per-node N` ends when its launcher dies, however.
    launched = watch_launcher()
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed reader shows here, not at exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 141  # 128 + SIGPIPE: what a shell shows for `cmd | head`
    except Exception as exc:
        if not (launched and peer_gone(exc)):
            raise
        # Another worker ended first (its error, or `| head` closing rank 0's output): the
        # launcher reports that one; this worker's gloo traceback would only hide it.
        return PEER_GONE_EXIT
    except KeyboardInterrupt as exc:
        if not launched:  # the launcher says it once for all its workers
            note = f"; {exc}" if str(exc) else ""
            _say(f"{PROG}: interrupted{note}")
        return 130


def _say(line: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # stderr closed: nothing to tell
        print(line, file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    """What a ddp worker other than rank 0 says about an error every rank raised: nothing."""


def _silence_stdout() -> None:
    # Python flushes stdout again at exit and would print "Exception ignored ... BrokenPipe";
    # point the descriptor at /dev/null so that last flush succeeds quietly.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _run(args_list: list[str]) -> int:
    from dataparallel.app.demo.options import TrainingError, TrainOptions, UsageError
    from dataparallel.app.demo.train import run_train
    from dataparallel.app.launch import TIMED_OUT_EXIT

    rank = os.environ.get("RANK", "0")
    prefix = PROG if rank == "0" else f"{PROG} (rank {rank})"
    # Under ddp every worker checks the same options and sees the same all-reduced loss, so a
    # usage or training error is raised by every rank alike: rank 0 says it, once; the others
    # end with the same exit code and no line of their own (not one line per rank, interleaved).
    say = _say if rank == "0" or os.environ.get("WORLD_SIZE", "1") == "1" else _quiet
    try:
        args = build_parser().parse_args(args_list)
        if args.command == "train":
            opts = TrainOptions(
                data=args.data,
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                momentum=args.momentum,
                seed=args.seed,
                devices=args.devices,
                strategy=args.strategy,
                nproc_per_node=args.nproc_per_node,
                trace=args.trace,
                checkpoint=args.checkpoint,
                resume=args.resume,
                overwrite=args.overwrite,
                plot=args.plot,
                json=args.json,
                progress=args.progress,
                batchnorm=args.batchnorm,
            )
            return run_train(opts, args_list)
        if args.command == "explain":
            return run_explain(args, sys.stdout)
        if args.command == "bench":
            return run_bench(args)
        raise UsageError("expected a command: train, explain or bench (see dataparallel -h)")
    except (UsageParseError, UsageError) as exc:
        speaker = getattr(exc, "speaker", "rank 0")
        if speaker == "self":  # only some ranks failed: the first says it, with its rank
            _say(f"{PROG} (rank {rank}): error: {_one_line(exc)}")
        elif speaker != "nobody":
            say(f"{prefix}: error: {_one_line(exc)}")
        return 2
    except TrainingError as exc:
        say(f"{prefix}: error: {_one_line(exc)}")
        return 3
    except TimeoutError as exc:
        speaks = getattr(exc, "speaks", None)  # a collective past the limit (distributed)
        if speaks is None:
            raise
        if speaks:  # the lowest rank still answering says it; it names the ranks that stopped
            _say(f"{PROG} (rank {rank}): error: {_one_line(exc)}")
        return TIMED_OUT_EXIT


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())  # one line, whatever the message held
