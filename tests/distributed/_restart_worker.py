"""A ``dataparallel`` CLI worker for torchrun that loses rank 1 once, after the first
checkpoint (issue 51, item 10): run by ``test_restarts.py``, never collected."""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any

from dataparallel.app.cli import main

ddp = importlib.import_module("dataparallel.app.demo.ddp")  # (the package exports a function)

_CHECK = ddp.check_finite_loss
_CHECKPOINT = sys.argv[sys.argv.index("--checkpoint") + 1]


def _check(*args: Any, **kwargs: Any) -> None:
    _CHECK(*args, **kwargs)  # every rank, after each epoch; rank 0 then writes the checkpoint
    first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if first_launch and os.environ.get("RANK") == "1":
        deadline = time.monotonic() + 60
        while not os.path.isfile(_CHECKPOINT) and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 0 writes it
        os._exit(3)  # a worker lost after the first epoch's checkpoint


ddp.check_finite_loss = _check
raise SystemExit(main(sys.argv[1:]))
