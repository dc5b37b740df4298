"""The seed scenarios S1-S6 as data: what ``dataparallel explain`` shows.

Each scenario is the call a user of ``torch.nn.DataParallel`` got wrong, with the devices and
options it runs on here. Tensors are made small where their size does not matter, so the
command runs in an instant; the shapes along the batch dimension are the seeds' own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["SCENARIOS", "Scenario"]


@dataclass(frozen=True)
class Scenario:
    """One seed call: its arguments, devices, options and what the user expects."""

    name: str
    title: str
    inputs: Any
    kwargs: dict[str, Any]
    devices: list[Any]
    opts: dict[str, Any] = field(default_factory=dict)
    expect: str = ""


def _s1() -> Scenario:
    arrays = [np.full((4, 4), i, dtype=np.float32) for i in range(16)]
    return Scenario(
        "S1",
        "a list of 16 per-sample ndarrays (seed 000)",
        (arrays,),
        {},
        ["cpu", "cpu"],
        expect="per-sample: each replica gets its 8 arrays, no index-tensor trick",
    )


def _s2() -> Scenario:
    x1 = torch.randn(10, 3, 128, 128)
    x2 = torch.randn(1, 100, 200)
    return Scenario(
        "S2",
        "model(x1, x2) with a shared batch-1 input (seed 003)",
        (x1, x2),
        {},
        ["cpu", "cpu"],
        expect="x1 split 5/5, x2 broadcast: outputs (10, 3, 128, 128) and (1, 100, 200)",
    )


def _s3() -> Scenario:
    x1 = torch.randn(10, 3, 16, 16)
    x2 = torch.randn(3, 100, 200)
    return Scenario(
        "S3",
        "a shared input of batch 3 beside a batch of 10 (seed 003)",
        (x1, x2),
        {},
        ["cpu", "cpu"],
        expect="x2 broadcast (the plan says why), not split 2/1",
    )


def _s4() -> Scenario:
    return Scenario(
        "S4",
        "the tutorial's RandomDataset batch of 30, then the last batch of 10 (seed 004)",
        (torch.randn(30, 5),),
        {},
        ["cpu", "cpu", "cpu"],
        expect="10/10/10 for a batch of 30; 4/3/3 for the last batch of 10",
    )


def _s4_last() -> Scenario:
    return Scenario(
        "S4-last",
        "the tutorial's last batch of 10 (seed 004)",
        (torch.randn(10, 5),),
        {},
        ["cpu", "cpu", "cpu"],
        expect="4/3/3",
    )


def _s5() -> Scenario:
    return Scenario(
        "S5",
        "a (16, 8) tensor on 4 devices (seed 002, mmcv's scatter)",
        (torch.randn(16, 8),),
        {},
        ["cpu"] * 4,
        expect="4 chunks of 4",
    )


def _s5_chunks() -> Scenario:
    return Scenario(
        "S5-chunks",
        "the same with chunk_sizes=[2, 6, 4, 4] and dtype=float16",
        (torch.randn(16, 8),),
        {},
        ["cpu"] * 4,
        opts={"chunk_sizes": [2, 6, 4, 4], "dtype": torch.float16},
        expect="chunks of 2, 6, 4, 4, cast to float16",
    )


def _s5_waves() -> Scenario:
    return Scenario(
        "S5-waves",
        "the same with max_size=3 (DataParallel runs waves)",
        (torch.randn(16, 8),),
        {},
        ["cpu"] * 4,
        opts={"max_size": 3},
        expect="two waves, no chunk above 3",
    )


def _s6() -> Scenario:
    return Scenario(
        "S6",
        "data_parallel(module, x, device_ids, output_device=-1) (seed 001)",
        (torch.randn(8, 4),),
        {},
        ["cpu", "cpu"],
        expect="the result lands on the CPU",
    )


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "S1": _s1,
    "S2": _s2,
    "S3": _s3,
    "S4": _s4,
    "S4-last": _s4_last,
    "S5": _s5,
    "S5-chunks": _s5_chunks,
    "S5-waves": _s5_waves,
    "S6": _s6,
}
