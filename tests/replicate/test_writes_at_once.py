"""Replicas that write a frozen parameter they share at the same moment, call after call, in a
process of their own: torch 2.13's copy-on-write aborted such a process (stop 75)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_RACE = """
import copy, sys, threading, torch
from torch import nn
import dataparallel as dp

class Ema(nn.Module):  # (test_forward_writes_seen.Gated, in a process of its own)
    def __init__(self, replicas):
        super().__init__()
        self.student = nn.Linear(256, 256)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.gate = [threading.Barrier(replicas)]

    def forward(self, x):
        self.gate[0].wait()
        with torch.no_grad():
            teacher = list(self.teacher.parameters())
            torch._foreach_lerp_(teacher, list(self.student.parameters()), 0.5)
        return self.student(x) + self.teacher(x)

torch.set_num_threads(2)
replicas, calls = int(sys.argv[1]), int(sys.argv[2])
wrapper = dp.DataParallel(Ema(replicas), ["cpu"] * replicas)
x = torch.randn(2 * replicas, 256)
for _ in range(calls):
    wrapper(x)
print("ran")
"""


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_writing_a_frozen_parameter_at_once_call_after_call_run_clean(
    replicas: int,
) -> None:
    """Every replica writes the shared teacher at the same moment (a barrier in forward), 1,500
    calls in a process of its own. Before: the process aborted ("malloc(): unaligned tcache
    chunk detected", rc -6) in 2 runs of 4 of 3,000 calls on two replicas, or hung; in 1 run
    of 8 of this test's."""
    run = subprocess.run(
        [sys.executable, "-c", _RACE, str(replicas), "1500"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert run.returncode == 0 and "ran" in run.stdout, run.stderr[-2000:]
