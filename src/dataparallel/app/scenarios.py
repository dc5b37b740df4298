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


# Each scenario's name and title, then (indented) what the user expects, in the order
# ``explain`` shows them: read as text, so the table reads as ``explain --help`` prints it.
_TEXT = """\
S1: a list of 16 per-sample ndarrays (seed 000)
    per-sample: each replica gets its 8 arrays, no index-tensor trick
S2: model(x1, x2) with a shared batch-1 input (seed 003)
    x1 split 5/5, x2 broadcast: outputs (10, 3, 128, 128) and (1, 100, 200)
S3: a shared input of batch 3 beside a batch of 10 (seed 003)
    x2 broadcast (the plan says why), not split 2/1
S4: the tutorial's RandomDataset batch of 30, then the last batch of 10 (seed 004)
    10/10/10 for a batch of 30; 4/3/3 for the last batch of 10
S4-last: the tutorial's last batch of 10 (seed 004)
    4/3/3
S5: a (16, 8) tensor on 4 devices (seed 002, mmcv's scatter)
    4 chunks of 4
S5-chunks: the same with chunk_sizes=[2, 6, 4, 4] and dtype=float16
    chunks of 2, 6, 4, 4, cast to float16
S5-waves: the same with max_size=3 (DataParallel runs waves)
    two waves, no chunk above 3
S6: data_parallel(module, x, device_ids, output_device=-1) (seed 001)
    the result lands on the CPU
"""

_Inputs = Callable[[], tuple[Any, ...]]

# Each scenario's positional inputs (built only when the scenario is: a 10x3x128x128 tensor is
# not made at import), its number of CPU devices and its options.
_CALLS: dict[str, tuple[_Inputs, int, dict[str, Any]]] = {
    "S1": (lambda: ([np.full((4, 4), i, dtype=np.float32) for i in range(16)],), 2, {}),
    "S2": (lambda: (torch.randn(10, 3, 128, 128), torch.randn(1, 100, 200)), 2, {}),
    "S3": (lambda: (torch.randn(10, 3, 16, 16), torch.randn(3, 100, 200)), 2, {}),
    "S4": (lambda: (torch.randn(30, 5),), 3, {}),
    "S4-last": (lambda: (torch.randn(10, 5),), 3, {}),
    "S5": (lambda: (torch.randn(16, 8),), 4, {}),
    "S5-chunks": (
        lambda: (torch.randn(16, 8),),
        4,
        {"chunk_sizes": [2, 6, 4, 4], "dtype": torch.float16},
    ),
    "S5-waves": (lambda: (torch.randn(16, 8),), 4, {"max_size": 3}),
    "S6": (lambda: (torch.randn(8, 4),), 2, {}),
}


def _maker(name: str, title: str, expect: str) -> Callable[[], Scenario]:
    """A function that builds scenario ``name`` afresh (new tensors, its own lists) each call."""
    inputs, count, opts = _CALLS[name]

    def make() -> Scenario:
        return Scenario(name, title, inputs(), {}, ["cpu"] * count, dict(opts), expect)

    return make


def _scenarios() -> dict[str, Callable[[], Scenario]]:
    """``_TEXT`` and ``_CALLS`` joined: each name's maker, in ``_TEXT``'s order."""
    lines = _TEXT.splitlines()
    made: dict[str, Callable[[], Scenario]] = {}
    for head, expect in zip(lines[::2], lines[1::2], strict=True):
        name, title = head.split(": ", 1)
        made[name] = _maker(name, title, expect.strip())
    return made


SCENARIOS: dict[str, Callable[[], Scenario]] = _scenarios()
"""Each seed scenario's name and the function that builds it, in the order ``explain`` shows."""
