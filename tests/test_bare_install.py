"""A bare ``pip install dataparallel`` (no extras) runs every CLI command, or says in one line
what to install.

The environment is built by ``scripts/bare_install.py``: the project's wheel installed with
``--no-deps --no-index`` into a new venv that sees only the base dependencies (linked from this
environment, nothing downloaded). scikit-learn, matplotlib and the dev tools are absent there,
so an optional import that leaks into a base path fails this test.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bare_install", ROOT / "scripts/bare_install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_command_works_or_says_what_to_install(tmp_path: Path) -> None:
    bare = _script()
    bin_dir = bare.make_bare_env(tmp_path)
    # The check can fail: the optional packages really are missing there, the base ones not.
    probe = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import importlib.util as u; "
            "print([m for m in ('sklearn', 'matplotlib', 'hypothesis', 'pytest') "
            "if u.find_spec(m)], [m for m in ('torch', 'numpy', 'tqdm') if not u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "[] []"
    outcomes = bare.run_commands(bin_dir, tmp_path)
    for outcome, (args, code, needle) in zip(outcomes, bare.COMMANDS, strict=True):
        what = f"dataparallel {' '.join(args)}: {outcome.stderr[-3000:]}"
        assert outcome.returncode == code, what
        assert "Traceback" not in outcome.stderr, what
        assert needle in outcome.last_line, what
        if code:  # a failure is one line on stderr, naming what to do
            assert outcome.stderr.count("\n") == 1, what
            assert "fix: " in outcome.stderr, what
        else:
            assert outcome.stdout.strip(), what


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_ships_py_typed(tmp_path: Path) -> None:
    """PEP 561: the marker that makes users' type checkers read our hints is in the wheel."""
    import zipfile

    wheel = _script()._wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        assert "dataparallel/py.typed" in z.namelist()
