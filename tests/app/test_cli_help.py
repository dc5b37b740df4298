"""What the command line tells a user: ``--help``, its examples (each one run here), the
``explain`` option checks, and what ``--resume`` and ``--checkpoint`` say.

The help is read as printed (``dataparallel <command> --help``); its per-dataset defaults are
compared with the datasets themselves, and every example of every command's help is run as
written in a scratch folder, except the timed benchmark runs listed in ``NOT_RUN``.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

# Imported at collection: scikit-learn sets KMP_* environment variables on first import, which
# the leak check in conftest.py would pin on whichever test imported it first.
from sklearn.datasets import load_digits  # noqa: F401

from dataparallel.app._parser import BENCH_FULL_TIME, BENCH_QUICK_TIME
from dataparallel.app.cli import build_parser, main
from dataparallel.app.demo.checkpoint import load_checkpoint
from dataparallel.app.demo.data import load_dataset, write_cifar_like
from dataparallel.app.scenarios import SCENARIOS

COMMANDS = ("train", "explain", "bench")

# Help examples not run here, each with the reason (the rest are run as written).
NOT_RUN = {
    "dataparallel bench": f"a timed run of {BENCH_QUICK_TIME}; the README check runs it",
    "dataparallel bench --out bench.json": "the same timed run, written elsewhere",
    "dataparallel bench --full": f"the full timed set, {BENCH_FULL_TIME}",
}


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _examples(text: str) -> list[str]:
    """The example commands of a help text: the lines under "examples:" that run the tool."""
    section = text.split("\nexamples:\n", 1)[1]
    return [line.strip() for line in section.splitlines() if line.startswith("  dataparallel ")]


def _run(command: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    argv = shlex.split(command)
    assert argv[0] == "dataparallel"
    code = main(argv[1:])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------ --help


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_says_what_it_does_and_its_default(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help([command], capsys)
    options = [a for a in _subparsers()[command]._actions if a.option_strings != ["-h", "--help"]]
    assert options
    for action in options:
        name = action.option_strings[-1] if action.option_strings else action.metavar
        assert action.help and action.help != argparse.SUPPRESS, name
        assert "default" in action.help, name
        # and it is printed: the option's first words appear in the help text
        first = " ".join(str(action.help).split()[:3])
        assert first in " ".join(text.split()), name


def test_per_dataset_defaults_in_help_are_the_datasets_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_cifar_like(tmp_path / "cifar", 20, 10)
    data = {
        "digits": load_dataset("digits"),
        "random": load_dataset("random"),
        "cifar10": load_dataset(f"cifar10:{folder}"),
    }
    text = " ".join(_help(["train"], capsys).split())
    for option, field in (("--epochs", "epochs"), ("--batch-size", "batch_size"), ("--lr", "lr")):
        expected = ", ".join(f"{name} {getattr(d, field)}" for name, d in data.items())
        assert f"(default per dataset: {expected})" in text, option
    assert "digits 20, random 1, cifar10 2" in text  # the numbers the issue quotes
    assert "digits 32, random 30, cifar10 32" in text
    assert "digits 0.02, random 0.1, cifar10 0.01" in text
    assert "--no-progress never show progress bars" in text


def test_explain_help_lists_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["explain"], capsys)
    for name, make in SCENARIOS.items():
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(make().title)}$", text, re.M), name


@pytest.mark.parametrize("argv", [[], ["train"], ["explain"], ["bench"]])
def test_every_help_has_examples(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    examples = _examples(_help(argv, capsys))
    assert len(examples) >= (1 if not argv else 3)
    if argv:
        assert all(e.startswith(f"dataparallel {argv[0]}") for e in examples)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["explain", "--devices", "cpu,cpu"], "--devices"),
        (["explain", "S2", "--devices", "cpu,cpu,cpu"], "--devices"),
        (["explain", "--batch-size", "10"], "--batch-size"),
    ],
)
def test_explain_options_for_data_are_not_ignored_without_it(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith(f"dataparallel: error: explain: {flag} applies to --data")
    assert "add --data digits, or drop " + flag in captured.err


# ------------------------------------------------------------------------ the help's examples


def _help_examples(command: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    found = _examples(_help([command], capsys))
    top = _examples(_help([], capsys))
    return found + [e for e in top if e.startswith(f"dataparallel {command}") and e not in found]


def test_every_train_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # capfd: the ddp example's workers are processes that print to the same stdout
    monkeypatch.chdir(tmp_path)
    write_cifar_like(tmp_path / "cifar-10-batches-py", 60, 20)  # stands in for the real set
    examples = _help_examples("train", capfd)
    assert any("--resume" in e for e in examples)
    for example in examples:
        code, out, err = _run(example, capfd)
        assert code == 0, f"{example}\n{err}"
        assert "test accuracy" in out, example
        if "--resume" in example:
            assert "resumed from run.pt after epoch 2 of 3" in out
    assert load_checkpoint(tmp_path / "run.pt")["epoch"] == 3
    assert (tmp_path / "run.json").is_file() and (tmp_path / "run.png").is_file()


def test_every_explain_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    examples = _help_examples("explain", capsys)
    for example in examples:
        code, out, err = _run(example, capsys)
        assert code == 0, f"{example}\n{err}"
        assert "each device receives" in out, example
    assert "Tensor[4/3/3, 5] float32" in _run(examples[-1], capsys)[1]


def test_bench_examples_are_each_run_or_listed(capsys: pytest.CaptureFixture[str]) -> None:
    examples = _help_examples("bench", capsys)
    assert set(examples) == set(NOT_RUN)  # a new bench example must be run or listed here
    parser = build_parser()
    for example in examples:  # each one at least parses as written
        parser.parse_args(shlex.split(example)[1:])


# ------------------------------------------------------------------- --resume, --checkpoint


def test_resume_of_a_finished_run_says_how_to_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "run.pt"
    base = ["train", "--data", "random", "--checkpoint", str(ckpt)]
    assert _run(" ".join(["dataparallel", *base, "--epochs", "2"]), capsys)[0] == 0
    code, out, err = _run(" ".join(["dataparallel", *base, "--epochs", "2", "--resume"]), capsys)
    assert code == 0, err
    assert (
        f"resumed from {ckpt}: the checkpoint already holds 2 of 2 epochs, so no epoch is "
        f"left to train; to train on, pass --epochs M with M > 2, e.g. --epochs 12 "
        f"--checkpoint {ckpt} --resume"
    ) in out
    assert "training: none in this run (the checkpoint already held 2 epochs)" in out
    assert "0 samples/s" not in out and "no training step ran" not in out
    assert "after 2 epochs" in out
    # the advice works: more epochs continue the run
    code, out, err = _run(" ".join(["dataparallel", *base, "--epochs", "3", "--resume"]), capsys)
    assert code == 0, err
    assert f"resumed from {ckpt} after epoch 2 of 3" in out and "epoch 3/3" in out
    assert load_checkpoint(ckpt)["epoch"] == 3


def test_resume_with_fewer_epochs_than_the_checkpoint_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "run.pt"
    base = f"dataparallel train --data random --checkpoint {ckpt}"
    assert _run(f"{base} --epochs 2", capsys)[0] == 0
    code, out, _ = _run(f"{base} --epochs 1 --resume", capsys)
    assert code == 0
    assert "the checkpoint already holds 2 epochs (1 asked for)" in out
    assert "pass --epochs M with M > 2" in out and "after 2 epochs" in out


def test_one_process_ddp_resume_of_a_finished_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ddp.pt"
    base = f"dataparallel train --data random --strategy ddp --checkpoint {ckpt} --epochs 1"
    assert _run(base, capsys)[0] == 0
    code, out, err = _run(f"{base} --resume", capsys)
    assert code == 0, err
    assert "the checkpoint already holds 1 of 1 epochs" in out
    assert "training: none in this run" in out


def test_checkpoint_says_where_it_wrote_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "run.pt"
    # with bars on (as on a terminal): one line for the checkpoint, not one per epoch
    argv = f"dataparallel train --data random --epochs 3 --checkpoint {ckpt} --progress"
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    line = (
        f"checkpoint written to {ckpt} after epoch 1; it is rewritten after every epoch "
        f"(continue with --checkpoint {ckpt} --resume)"
    )
    assert out.count(line) == 1 and out.count("checkpoint written") == 1
    assert "epoch 1/3" in err  # the bars were on
    assert load_checkpoint(ckpt)["epoch"] == 3
    # a resumed run says it once too, from its first epoch
    code, out, _ = _run(f"{argv} --epochs 5 --resume", capsys)
    assert code == 0 and out.count("checkpoint written") == 1
    assert f"checkpoint written to {ckpt} after epoch 4;" in out


def test_building_the_help_leaves_the_random_state_alone() -> None:
    import torch

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_parser()  # lists the scenarios, whose inputs are random
    assert torch.equal(torch.rand(3), expected)


def test_bench_durations_in_help_are_the_readmes(capsys: pytest.CaptureFixture[str]) -> None:
    # One measured figure each, said alike by `bench --help` and docs/benchmarks.md.
    text = " ".join(_help(["bench"], capsys).split())
    assert f"the full set, {BENCH_FULL_TIME}" in text
    assert f"the quick set, {BENCH_QUICK_TIME}" in text
    page = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
    text = " ".join(page.read_text().split())
    assert f"`make bench` (the full set, {BENCH_FULL_TIME}," in text
    assert f"`.venv/bin/dataparallel bench` (the quick set, {BENCH_QUICK_TIME})" in text
