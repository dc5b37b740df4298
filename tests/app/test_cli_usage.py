"""Usage errors of the ``dataparallel`` command line in the house style (issue 30, item 4): one
line that says what was found, what was expected and the fix, "did you mean" where a close name
exists; abbreviations refused; an empty path refused; under ddp, one line for all the ranks."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Imported at collection: scikit-learn sets KMP_* environment variables on first import, which
# the leak check in conftest.py would pin on whichever test imported it first.
from sklearn.datasets import load_digits  # noqa: F401

from dataparallel.app.cli import build_parser, main

ERROR_PREFIX = "dataparallel: error: "


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a usage error (exit 2, nothing on stdout, no traceback)."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    assert err.startswith(ERROR_PREFIX) and err.count("\n") == 1, err
    line = err.removeprefix(ERROR_PREFIX).rstrip("\n")
    assert "expected" in line and "got" in line and "fix: " in line, line
    return line


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_parser_refuses_abbreviations() -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) == 4  # the top level, train, explain, bench
    assert all(p.allow_abbrev is False for p in parsers)


@pytest.mark.parametrize(
    ("argv", "found", "suggestion"),
    [
        (["train", "--epoch", "3", "--data", "random"], "'--epoch'", "did you mean '--epochs'?"),
        (["train", "--data", "random", "--batch", "4"], "'--batch'", "did you mean"),
        (["bench", "--fulll"], "'--fulll'", "did you mean '--full'?"),
        (["train", "--strategy", "ddpp"], "'ddpp'", "did you mean 'ddp'? (--strategy ddp)"),
        (["trian"], "'trian'", "did you mean 'train'? (dataparallel train ...)"),
        (["explian"], "'explian'", "did you mean 'explain'?"),
        (["--epochs", "3"], "'3'", "fix: pass train, explain or bench"),
    ],
)
def test_a_mistyped_name_gets_did_you_mean(
    argv: list[str], found: str, suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error(argv, capsys)
    assert found in line and suggestion in line, line


def test_an_unknown_option_far_from_any_lists_what_is_expected(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _error(["train", "--zzz"], capsys)
    assert line.startswith("train: unknown option --zzz: expected one of --batch-size, ")
    assert "did you mean" not in line and "fix: see `dataparallel train -h`" in line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "--epochs"], "expected one argument, got none; fix: give it a value"),
        (["train", "--progress", "--no-progress"], "fix: pass only one of the two"),
        (["train", "extra"], "got the extra argument(s) 'extra'; fix: drop them"),
        (["explain", "--batch-size", "0"], "expected an integer >= 1, got 0"),
    ],
)
def test_argparses_own_errors_carry_a_fix(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error(argv, capsys)
    assert expected in line, line


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["train", "--data", "random", "--json", ""], "--json"),
        (["train", "--data", "random", "--plot", " "], "--plot"),
        (["train", "--data", "random", "--checkpoint="], "--checkpoint"),
        (["bench", "--out", ""], "--out"),
    ],
)
def test_an_empty_path_is_an_error_not_none(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error(argv, capsys)
    assert f"argument {option}: expected a file path, got " in line
    assert "or leave the option out" in line


def test_output_paths_say_a_missing_folder_is_created_and_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split("\noptions:\n", 1)[1].split())
    for option in ("--checkpoint PATH", "--plot PATH", "--json PATH"):
        part = text.split(option, 1)[1].split("(default", 1)[0]
        assert "a missing folder is created" in part, (option, part)
    target = tmp_path / "new" / "deeper" / "run.json"
    assert main(["train", "--data", "random", "--epochs", "0", "--json", str(target)]) == 0
    capsys.readouterr()
    assert target.is_file()


DDP_DIVERGES = [
    "train",
    "--strategy",
    "ddp",
    "--nproc-per-node",
    "2",
    "--devices",
    "cpu",
    "--lr",
    "1e10",
    "--epochs",
    "1",
]


def test_ddp_workers_report_an_error_once(tmp_path: Path) -> None:
    # Both workers see the same all-reduced loss go NaN: one line, from rank 0, not two.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "dataparallel", *DDP_DIVERGES],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [line for line in errors if line.startswith(ERROR_PREFIX)], proc.stderr
    assert len(errors) == 1 and "expected a finite loss" in errors[0], proc.stderr
