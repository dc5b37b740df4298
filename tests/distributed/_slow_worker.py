"""``python -m tests.distributed._slow_worker ARGS``: the command line (``dataparallel ARGS``)
with rank 2 asleep ``SLOW_S`` seconds (10 by default) before the first epoch's figures, so the
others wait for it in that all-reduce while every rank still answers."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from dataparallel.app.cli import main
from dataparallel.app.demo import ddp

_real = ddp._epoch_figures


def _late(*args: Any, **kwargs: Any) -> Any:
    if os.environ.get("RANK") == "2":
        time.sleep(float(os.environ.get("SLOW_S", "10")))
    return _real(*args, **kwargs)


if __name__ == "__main__":
    ddp._epoch_figures = _late  # type: ignore[assignment]
    sys.exit(main())
