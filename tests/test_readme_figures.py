"""The README's measured figures are the committed results' figures, and the default run's
accuracy in them is what a fresh ``make train`` prints."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dataparallel.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    path = ROOT / "scripts" / "readme_figures.py"
    spec = importlib.util.spec_from_file_location("readme_figures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_readme_figures_are_the_committed_results() -> None:
    figures = _script()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    fresh = figures.render()
    assert set(fresh) <= set(figures.regions(text))
    for name, body in fresh.items():
        assert figures.regions(text)[name] == body, (
            f"README region {name!r} differs from benchmarks/results; run make readme-figures"
        )


def test_the_check_fails_when_a_number_drifts() -> None:
    figures = _script()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    train = json.loads(figures.TRAIN_DEFAULT.read_text())
    correct = sum(c["correct"] for c in train["per_class"].values())
    line = f"({correct}/"
    assert line in text
    drifted = text.replace(line, f"({correct - 1}/", 1)
    assert figures.rendered_readme(drifted) == text  # the script puts the true number back


def test_committed_default_run_is_consistent() -> None:
    train = json.loads((ROOT / "benchmarks/results/train-default.json").read_text())
    assert train["command"] == "dataparallel train"
    assert train["data"] == "digits" and train["strategy"] == "dp" and train["epochs"] == 20
    correct = sum(c["correct"] for c in train["per_class"].values())
    total = sum(c["total"] for c in train["per_class"].values())
    assert total == 360 and train["test_accuracy"] == pytest.approx(correct / total)


@pytest.mark.slow
def test_a_fresh_default_run_prints_the_readme_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = _script()
    train = json.loads(figures.TRAIN_DEFAULT.read_text())
    here, there = figures.machine(), train["machine"]
    keys = ("cpu", "torch", "torch_threads")
    if any(here[k] != there[k] for k in keys):
        pytest.skip(
            f"the committed run was measured on {[there[k] for k in keys]}, this machine is "
            f"{[here[k] for k in keys]}: floating point rounds differently there"
        )
    out = tmp_path / "run.json"
    assert main(["train", "--no-progress", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    fresh = json.loads(out.read_text())
    assert fresh["per_class"] == train["per_class"]
    correct = sum(c["correct"] for c in train["per_class"].values())
    assert f"test accuracy {train['test_accuracy']:.4f} ({correct}/360)" in printed
