"""The integration suite: real model code (transformers, PyTorch Geometric, torch's RNNs,
parametrizations, checkpointing, compile, peft) against the same module on one device.

Nothing is downloaded: models are built from tiny configs with random weights, and the
HuggingFace hub is switched off before transformers is imported. Set DP_REPORT_DIFFS=1 to
print the largest difference from one device that each case measured.
"""

from __future__ import annotations

import os

import pytest

# Before any test runs (the leak check compares the environment around each test), and before
# transformers reads it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import tqdm

from ._oracle import DIFFS

# peft and transformers show tqdm bars; tqdm's monitor thread would outlive the test that
# first shows one, and the leak check would fail it.
tqdm.tqdm.monitor_interval = 0


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not os.environ.get("DP_REPORT_DIFFS") or not DIFFS:
        return
    terminalreporter.section("largest difference from one device, per case")
    for case, diff in sorted(DIFFS.items()):
        terminalreporter.write_line(f"{case}: {diff:.3g}")
