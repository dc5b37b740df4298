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


@pytest.mark.skipif(not (VENV / "bin" / "dataparallel").exists(), reason="needs make setup")
def test_every_readme_command_runs_as_written(
    commands: list[tuple[str, str | None]], tmp_path: Path
) -> None:
    (tmp_path / ".venv").symlink_to(VENV)
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    write_cifar_like(tmp_path / "cifar-10-batches-py", 200, 50)
    results = ROOT / "benchmarks" / "results"
    before = set(results.iterdir())
    skip = dict(NOT_RUN)
    if torch.cuda.is_available():
        skip.update(GPU_ONLY)
    env = _fresh_shell_env()
    failures = []
    ran = []
    try:
        for command, expected in commands:
            if command in skip:
                continue
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            ran.append(command)
            if done.returncode != 0:
                failures.append(f"{command}: exit {done.returncode}\n{done.stderr[-2000:]}")
            elif expected is not None and done.stdout != expected:
                failures.append(f"{command}: the README shows other output:\n{done.stdout}")
            elif "--resume" in command and "resumed from run.pt after epoch 2 of 4" not in (
                done.stdout
            ):
                failures.append(f"{command}: did not continue the run:\n{done.stdout}")
    finally:
        for path in set(results.iterdir()) - before:  # `dataparallel bench` writes its JSON here
            path.unlink()
    assert not failures, "\n\n".join(failures)
    assert "make train" in ran and len(ran) == len(commands) - len(skip)
    assert (tmp_path / "run.png").is_file() and (tmp_path / "run.json").is_file()


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
    """Each row of the README's table of versions is a run of ``.ci/run``: the same Python
    (found by ``python_for``) with the same constraints."""
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [line.strip() for line in ci.splitlines() if line.strip().startswith("make test")]
    assert runs[:2] == ["make test", "make test-newest"]
    found = dict(re.findall(r"^(\w+)=\$\(python_for (3\.\d+)\)$", ci, flags=re.M))
    for command in OTHER_PYTHONS:
        minor = re.search(r"python(3\.\d+)", command)
        assert minor is not None
        [variable] = [v for v, m in found.items() if m == minor.group(1)]
        constraints = command.split("CONSTRAINTS=")[1] if "CONSTRAINTS=" in command else None
        expected = f'make test PYTHON="${variable}"' + (
            f" CONSTRAINTS={constraints}" if constraints else ""
        )
        assert expected in runs, (command, runs)
    readme = README.read_text()
    tested = re.findall(r"^\| (3\.\d+)", readme, flags=re.M)
    classifiers = re.findall(
        r'"Programming Language :: Python :: (3\.\d+)"', (ROOT / "pyproject.toml").read_text()
    )
    assert (
        sorted(set(tested), key=lambda v: int(v[2:]))
        == classifiers
        == [
            "3.10",
            "3.11",
            "3.12",
            "3.13",
        ]
    )
