"""Every command the README and its docs pages give runs as written, its sample output is the
real one, and the README's first example runs as a program.

The commands are read from the README and ``docs/`` (in that order): each line of a ```bash
block (with its ``\\`` continuations, without its trailing ``# comment``), each ``$ command`` of
a plain block (whose following lines are the output it prints), and each inline ``make ...`` or
``.venv/bin/...`` span. They run with bash, in that order, in a scratch folder that holds what
a fresh clone after ``make setup`` holds (``.venv``, the Makefile, pyproject.toml,
constraints.txt, benchmarks/), so files they write (run.pt, run.png) land there.
``cifar-10-batches-py`` is a small stand-in in the official format: nothing is downloaded.

The commands not run are listed in ``NOT_RUN`` with the reason. The first Python block under
"## Use" is a complete program and runs as one; the other Python snippets are illustrations
(they use the reader's model and data), not commands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dataparallel.app._parser import BENCH_FULL_TIME
from dataparallel.app.demo.data import write_cifar_like

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "guide.md", ROOT / "docs" / "benchmarks.md")
# The venv running this suite stands for ``.venv`` in the scratch folder, so that a run on
# another Python (``make test PYTHON=python3.13``: ``.venv-python3.13``) runs the README's
# commands on that Python too.
_RUNNING = Path(sys.prefix)
VENV = _RUNNING if (_RUNNING / "bin" / "dataparallel").exists() else ROOT / ".venv"

MULTI_NODE = (
    ".venv/bin/torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "
    "HOST0:29400 --rdzv-id myjob -m dataparallel train --strategy ddp"
)
CPU_INDEX = 'make test PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"'
OTHER_PYTHONS = (
    "make test PYTHON=python3.10",
    "make test PYTHON=python3.12",
    "make test PYTHON=python3.13 CONSTRAINTS=constraints-newest.txt",
)
NOT_RUN = {
    "make test": "runs this very suite (with ruff and mypy): it is what runs this file",
    "make bench": f"the full benchmark set, {BENCH_FULL_TIME} of timed runs; its quick set, "
    "`.venv/bin/dataparallel bench`, is run",
    "make test-newest": "runs this very suite on the newest torch, in a second venv",
    CPU_INDEX: "downloads torch from PyTorch's own index, which this machine cannot reach: "
    "test_the_cpu_index_command_reaches_pip checks that the option gets to pip",
    **{
        command: "this very suite on another Python, in CI (.ci/run): "
        "test_ci_runs_every_version_the_readme_lists checks it is there"
        for command in OTHER_PYTHONS
    },
    "make readme-figures": "retrains and rewrites README.md and benchmarks/results/ in place; "
    "tests/test_readme_figures.py checks its output against the README and a fresh run",
    "make docs": "builds the reference with Sphinx, which it installs into the venv: CI runs "
    "it (.ci/run), and tests/test_reference.py checks its sources",
    "make check-bare": "builds a second environment from the wheel; tests/test_bare_install.py "
    "runs the same script (scripts/bare_install.py)",
    MULTI_NODE: "two machines: needs HOST0 and a second node running the same command",
    ".venv/bin/python benchmarks/bench_train_ddp.py": "about 90 s of timed DDP runs that "
    "rewrite the committed benchmarks/results/ddp-train.json; tests/test_benchmarks.py runs one "
    "short round of it",
}
GPU_ONLY = {
    # Without CUDA these say so and exit 0, which is what runs here; with CUDA they are the
    # timed GPU set, run by hand on the GPU machine.
    "make bench-gpu": "the timed GPU benchmark set",
    ".venv/bin/python benchmarks/bench_gpu.py": "the timed GPU benchmark set",
}


# What ``make`` hands its recipes: a ``make test PYTHON=... CONSTRAINTS=...`` that runs this
# suite exports its command-line variables and passes them on to every ``make`` a test runs
# (MAKEFLAGS), so the README's ``make train`` would set up another venv than a reader's shell
# gets. The Makefile's own variables go too.
_MAKE_ENV = (
    "MAKEFLAGS",
    "MFLAGS",
    "MAKELEVEL",
    "MAKEOVERRIDES",
    "PYTHON",
    "VENV",
    "CONSTRAINTS",
    "PIP_ARGS",
    "ARGS",
)


def _fresh_shell_env() -> dict[str, str]:
    """The environment a reader's shell has: this process's, less pytest's and make's."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k not in _MAKE_ENV
    }


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).strip()


def readme_commands(text: str) -> list[tuple[str, str | None]]:
    """``(command, expected output or None)`` for every command of the README, in order."""
    found: list[tuple[int, str, str | None]] = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        lang, body = block.group(1), block.group(2)
        if lang == "bash":
            joined = re.sub(r"\\\n\s*", "", body)
            for line in joined.splitlines():
                command = _strip_comment(line)
                if command:
                    found.append((block.start(), command, None))
        elif lang == "" and body.startswith("$ "):
            first, _, output = body.partition("\n")
            found.append((block.start(), _strip_comment(first[2:]), output))
    for span in re.finditer(r"`((?:make |\.venv/bin/)[^`]+)`", text):
        found.append((span.start(), span.group(1), None))
    seen: set[str] = set()
    ordered = []
    for _, command, output in sorted(found, key=lambda item: item[0]):
        if command not in seen:
            seen.add(command)
            ordered.append((command, output))
    return ordered


@pytest.fixture(scope="module")
def commands() -> list[tuple[str, str | None]]:
    return readme_commands("\n".join(page.read_text(encoding="utf-8") for page in PAGES))


def first_example(text: str) -> str:
    """The first ```python block after the README's "## Use" heading."""
    use = text.index("\n## Use\n")
    block = re.compile(r"^```python\n(.*?)^```$", re.M | re.S).search(text, use)
    assert block is not None, "README.md: no ```python block under ## Use"
    return block.group(1)


def test_the_first_example_runs_as_written(tmp_path: Path) -> None:
    # A newcomer copies it into a file and runs it: no name it does not define, and devices
    # that exist on this machine (every GPU, else two CPU replicas).
    script = tmp_path / "first.py"
    script.write_text(first_example(README.read_text(encoding="utf-8")), encoding="utf-8")
    env = _fresh_shell_env()
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines()[:3]] == [
        "step 0",
        "step 1",
        "step 2",
    ]
    losses = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()[:3]]
    assert losses[2] < losses[0]  # it trains
    if not torch.cuda.is_available():
        assert "chunk sizes: [5, 5]" in done.stdout and "devices used (2): cpu, cpu" in done.stdout


def test_the_readme_gives_the_commands_as_the_setup_makes_them_work(
    commands: list[tuple[str, str | None]],
) -> None:
    names = [c for c, _ in commands]
    assert "make train" in names and "make test" in names
    for command in names:
        # no bare `python`, `dataparallel` or `torchrun`: only .venv has them after make setup
        assert command.split()[0] in ("make", ".venv/bin/python", ".venv/bin/dataparallel") or (
            command.startswith(".venv/bin/torchrun ")
        ), command
    for command in [*NOT_RUN, *GPU_ONLY]:
        assert command in names, f"NOT_RUN/GPU_ONLY lists a command the README lacks: {command}"


_ALL_COMMANDS = readme_commands("\n".join(page.read_text(encoding="utf-8") for page in PAGES))
_SKIP = {**NOT_RUN, **(GPU_ONLY if torch.cuda.is_available() else {})}
_TO_RUN = [(command, expected) for command, expected in _ALL_COMMANDS if command not in _SKIP]
_NEEDS_SETUP = pytest.mark.skipif(
    not (VENV / "bin" / "dataparallel").exists(), reason="needs make setup"
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder the README's commands run in, one for all of them: a later command reads
    what an earlier one wrote (``--resume`` continues ``run.pt``), as in a reader's shell."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / ".venv").symlink_to(VENV)
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "benchmarks", "scripts"):
        (folder / name).symlink_to(ROOT / name)
    write_cifar_like(folder / "cifar-10-batches-py", 200, 50)
    results = ROOT / "benchmarks" / "results"
    before = set(results.iterdir())
    yield folder
    for path in set(results.iterdir()) - before:  # `dataparallel bench` writes its JSON here
        path.unlink()


# Each command is a test of its own, with a limit of its own: one test for all of them timed
# out on a loaded 2-core machine (300 s for about 150 s of commands run alone). They run in the
# README's order in one folder (pytest keeps a parametrised test's order).
@_NEEDS_SETUP
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("command", "expected"), _TO_RUN, ids=[c for c, _ in _TO_RUN])
def test_the_readme_command_runs_as_written(
    command: str, expected: str | None, scratch: Path
) -> None:
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=scratch,
        env=_fresh_shell_env(),
        capture_output=True,
        text=True,
        timeout=570,
    )
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-2000:]}"
    if expected is not None:
        assert done.stdout == expected, f"{command}: the README shows other output"
    if "--resume" in command:
        assert "resumed from run.pt after epoch 2 of 4" in done.stdout, done.stdout


@_NEEDS_SETUP
@pytest.mark.slow
def test_the_readme_commands_left_what_they_promise(scratch: Path) -> None:
    """After every command ran (the tests above, in the same folder): the files they write."""
    assert "make train" in [c for c, _ in _TO_RUN]
    assert len(_TO_RUN) == len(_ALL_COMMANDS) - len(_SKIP)
    assert (scratch / "run.png").is_file() and (scratch / "run.json").is_file()


def test_the_cpu_index_command_reaches_pip(tmp_path: Path) -> None:
    """The README's command for a machine without a GPU hands PyTorch's CPU index to the pip
    that installs the project (``make -n``: what make would run, run here without a download),
    alongside the pins."""
    args = CPU_INDEX.split(" ", 2)[2]  # PIP_ARGS="..."
    name, value = args.split("=", 1)
    fresh = tmp_path / "venv"
    shown = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "setup", f"{name}={value.strip(chr(34))}", f"VENV={fresh}"],
        env=_fresh_shell_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [line for line in shown.splitlines() if "pip install" in line and "-e " in line]
    assert len(installs) == 1, shown
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in installs[0]
    assert "-c constraints.txt" in installs[0]


def test_ci_runs_every_version_the_readme_lists() -> None:
    """Each row of the README's table of versions is a line of ``.ci/run``, written exactly as
    the README writes it, and the table covers every Python the package claims."""
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [line.strip() for line in ci.splitlines() if line.strip().startswith("make test")]
    readme = README.read_text()
    table = re.findall(r"^\| 3\.\d+.*\| `(make test[^`]*)` \|$", readme, flags=re.M)
    assert table == runs == ["make test", "make test-newest", *OTHER_PYTHONS]
    tested = re.findall(r"^\| (3\.\d+)", readme, flags=re.M)
    classifiers = re.findall(
        r'"Programming Language :: Python :: (3\.\d+)"', (ROOT / "pyproject.toml").read_text()
    )
    assert sorted(set(tested), key=lambda v: int(v[2:])) == classifiers
    assert classifiers == ["3.10", "3.11", "3.12", "3.13"]


def test_a_python_is_found_by_its_name() -> None:
    """``make test PYTHON=python3.X`` finds the interpreter on PATH or in pyenv
    (scripts/find_python.sh), as the README says; a missing one is one line naming it."""
    find = ROOT / "scripts" / "find_python.sh"
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = subprocess.run(
        [str(find), f"python{minor}"], capture_output=True, text=True, env=_fresh_shell_env()
    )
    assert found.returncode == 0, found.stderr
    version = subprocess.run(
        [found.stdout.strip(), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == str(sys.version_info[:2])
    missing = subprocess.run(
        [str(find), "python3.99"], capture_output=True, text=True, env=_fresh_shell_env()
    )
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "python3.99" in missing.stderr


def test_a_changed_pip_args_sets_the_venv_up_again(tmp_path: Path) -> None:
    """``PIP_ARGS`` reaches pip when it differs from the one the venv was set up with (pip
    would keep an installed torch that satisfies the pins, so the venv is made again); the same
    or no ``PIP_ARGS`` leaves a venv that is up to date alone."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()
    (venv / ".pip-args").write_text("--index-url https://example.invalid/simple\n")

    def dry_run(*extra: str) -> str:
        return subprocess.run(
            ["make", "-n", "-C", str(ROOT), "setup", f"VENV={venv}", *extra],
            env=_fresh_shell_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    assert "pip install" not in dry_run()
    assert "pip install" not in dry_run("PIP_ARGS=--index-url https://example.invalid/simple")
    changed = dry_run(f"{CPU_INDEX.split(' ', 2)[2].replace(chr(34), '')}")
    assert f"rm -rf {venv}" in changed
    assert "--extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt" in changed
