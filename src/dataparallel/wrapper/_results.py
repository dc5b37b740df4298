"""What a ``DataParallel`` call returns and reports besides its gathered output.

``CallStats`` is a call's load (``model.last_call``), ``DeviceOutputs`` the ungathered outputs
of a ``gather=False`` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CallStats", "DeviceOutputs"]


@dataclass(frozen=True)
class CallStats:
    """The load of the last call: one row per chunk (device, samples, seconds).

    A replica that takes much longer than the others for the same samples is a slow device;
    ``weights=`` or ``chunk_sizes=`` can even the load out.
    """

    devices: list[str]
    chunk_sizes: list[int]
    timers: list[Any]  # floats, or CUDA spans read (synchronizing) only when asked
    waves: int = 1

    @property
    def seconds(self) -> list[float]:
        """Each chunk's time in seconds (on CUDA this waits for the replicas' streams)."""
        return [float(t) for t in self.timers]

    def __str__(self) -> str:
        rows = [("replica", "device", "samples", "ms", "samples/s")]
        for i, (dev, size, sec) in enumerate(
            zip(self.devices, self.chunk_sizes, self.seconds, strict=True)
        ):
            rate = f"{size / sec:,.0f}" if sec > 0 else "-"
            rows.append((str(i), dev, str(size), f"{sec * 1e3:.2f}", rate))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        if self.waves > 1:
            lines.append(f"({self.waves} waves)")
        return "\n".join(lines)


class DeviceOutputs(list[Any]):
    """The per-device outputs of a ``gather=False`` call, in batch order.

    A list (one output per chunk) that also carries ``devices`` and ``chunk_sizes``, so that
    ``DataParallelCriterion`` or your own code can finish the work on each device.
    """

    def __init__(
        self, outputs: Sequence[Any], devices: Sequence[torch.device], chunk_sizes: Sequence[int]
    ) -> None:
        super().__init__(outputs)
        self.devices = list(devices)
        self.chunk_sizes = list(chunk_sizes)
