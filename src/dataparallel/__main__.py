"""``python -m dataparallel``: the same command line as ``dataparallel``."""

from __future__ import annotations

from dataparallel.app.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
