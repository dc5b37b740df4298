"""The corpus's fixture: transformers' ``TrainingArguments`` writes settings into
``os.environ`` (the device, mixed precision); put it back, so the suite's leak check sees
what it saw before."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
