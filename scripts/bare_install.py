"""Install ``dataparallel`` without extras into a fresh virtual environment, offline, and try
every command of its CLI there.

``python scripts/bare_install.py [DIR]`` builds the project's wheel, creates a venv in ``DIR``
(default: a temporary folder) that sees nothing of this environment, installs the wheel with
``--no-deps --no-index``, and gives it the base dependencies (torch, numpy, tqdm and what they
need, read from the wheel's own ``Requires-Dist``) by linking the installed distributions of this
environment into it. Optional packages (scikit-learn, matplotlib, pytest, hypothesis, ...) are
simply absent, so an import of one of them on a base path fails there as it would after a bare
``pip install dataparallel``. Then it runs each command and prints its exit code and last line.

Nothing is downloaded: this runs on an offline machine as well as on CI.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["COMMANDS", "Outcome", "base_closure", "make_bare_env", "run_commands"]


@dataclass(frozen=True)
class Outcome:
    """One command run in the bare environment."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        """The last non-empty line of its output (stderr when it failed, else stdout)."""
        text = self.stderr if self.returncode else self.stdout
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else ""


# (arguments after `dataparallel`, the exit code expected, a text its last line must hold)
COMMANDS: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("train", "--data", "random"), 0, ""),
    (("train", "--data", "random", "--strategy", "ddp"), 0, ""),
    (("train", "--data", "random", "--strategy", "ddp", "--nproc-per-node", "2"), 0, ""),
    (("explain",), 0, ""),
    (("explain", "--data", "random", "--devices", "cpu,cpu"), 0, ""),
    (("train",), 2, "pip install 'dataparallel[demo]'"),
    (("explain", "--data", "digits"), 2, "pip install 'dataparallel[demo]'"),
    (("train", "--data", "random", "--plot", "run.png"), 2, "pip install 'dataparallel[plot]'"),
    (("bench",), 2, "source checkout"),
)


def _requirement_parser() -> Any:
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    return Requirement


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_closure(requires: list[str]) -> list[md.Distribution]:
    """The installed distributions that ``requires`` (no extras) needs, transitively.

    Raises:
        RuntimeError: a required distribution is not installed in this environment.
    """
    requirement = _requirement_parser()
    seen: dict[str, md.Distribution] = {}
    todo = list(requires)
    while todo:
        req = requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = _canonical(req.name)
        if key in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError as exc:
            raise RuntimeError(f"{req.name}: required by the base install, not installed") from exc
        seen[key] = dist
        todo.extend(dist.requires or [])
    return list(seen.values())


def _wheel(out: Path) -> Path:
    flags = ["--no-deps", "--no-cache-dir", "-w", str(out)]
    try:
        import setuptools

        # The build backend is here already: build without fetching it (works offline).
        if int(setuptools.__version__.split(".")[0]) >= 77:
            flags.append("--no-build-isolation")
    except ImportError:
        pass
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", *flags, str(ROOT)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("dataparallel-*.whl"))


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = z.read(name).decode("utf-8")
    return [
        line.split(":", 1)[1].strip()
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]


def make_bare_env(folder: Path) -> Path:
    """Build the bare environment in ``folder``; returns its ``bin`` folder."""
    wheel = _wheel(folder / "wheel")
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bare_python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(bare_python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for dist in base_closure(_wheel_requires(wheel)):
        base = Path(str(dist.locate_file(""))).resolve()
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if ".." not in Path(str(f)).parts}
        for top in sorted(tops):
            source = base / top
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source, target_is_directory=source.is_dir())
    pip = [sys.executable, "-m", "pip", "--python", str(bare_python)]
    subprocess.run(
        [*pip, "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"pip check in the bare environment: {check.stdout}{check.stderr}")
    return venv / "bin"


def run_commands(bin_dir: Path, cwd: Path, timeout: float = 300) -> list[Outcome]:
    """Run each of :data:`COMMANDS` with the bare environment's ``dataparallel`` in ``cwd``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PYTEST", "COV_"))
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    outcomes = []
    for args, _, _ in COMMANDS:
        done = subprocess.run(
            [str(bin_dir / "dataparallel"), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        outcomes.append(Outcome(args, done.returncode, done.stdout, done.stderr))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """Build the environment, run every command, print each one's exit code and last line."""
    args = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="dataparallel-bare-") as tmp:
        folder = Path(args[0]) if args else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        bin_dir = make_bare_env(folder)
        failed = 0
        for outcome, (_, code, needle) in zip(run_commands(bin_dir, folder), COMMANDS, strict=True):
            ok = outcome.returncode == code and needle in outcome.last_line
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} $ dataparallel {' '.join(outcome.argv)}")
            print(f"     exit {outcome.returncode}: {outcome.last_line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
