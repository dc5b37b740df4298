"""What a ``DataParallel`` call returns and reports besides its gathered output.

``CallStats`` is a call's load (``model.last_call``), ``DeviceOutputs`` the ungathered outputs
of a ``gather=False`` call. A call records a ``Load`` (``record``), and ``LastCall`` makes the
``CallStats`` from it only when ``last_call`` is read, one per thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, overload

import torch

__all__ = ["CallStats", "DeviceOutputs", "LastCall", "Load", "new_load", "record"]


@dataclass(frozen=True)
class CallStats:
    """The load of the last call: one row per chunk (device, samples, seconds).

    A replica that takes much longer than the others for the same samples is a slow device;
    ``weights=`` or ``chunk_sizes=`` can even the load out. Made by the wrapper, read from
    ``wrapper.last_call``; ``print`` shows it as a table.

    Attributes:
        devices (list[str]): each chunk's device, in batch order (``"cpu"``, ``"cuda:1"``).
        chunk_sizes (list[int]): each chunk's samples (a device runs a chunk per wave).
        timers (list): each chunk's time, as ``seconds`` reads it.
        waves (int): how many waves the call ran in (more than one under ``max_size``).
        seconds (list[float]): each chunk's time in seconds.

    Example:
        >>> import torch, dataparallel as dp
        >>> model = dp.DataParallel(torch.nn.Linear(3, 1), ["cpu", "cpu"], max_size=2)
        >>> _ = model(torch.zeros(6, 3))
        >>> stats = model.last_call
        >>> stats.devices, stats.chunk_sizes, stats.waves, len(stats.seconds)
        (['cpu', 'cpu', 'cpu', 'cpu'], [2, 1, 2, 1], 2, 4)
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

    Attributes:
        devices (list[torch.device]): the device each output is on.
        chunk_sizes (list[int]): the samples each output was computed from.

    Example:
        >>> import torch, dataparallel as dp
        >>> model = dp.DataParallel(torch.nn.Linear(3, 1), ["cpu", "cpu"], gather=False)
        >>> outs = model(torch.zeros(5, 3))
        >>> [o.shape[0] for o in outs], outs.chunk_sizes, [d.type for d in outs.devices]
        ([3, 2], [3, 2], ['cpu', 'cpu'])
    """

    def __init__(
        self, outputs: Sequence[Any], devices: Sequence[torch.device], chunk_sizes: Sequence[int]
    ) -> None:
        super().__init__(outputs)
        self.devices = list(devices)
        self.chunk_sizes = list(chunk_sizes)


class Load(NamedTuple):
    """What a call records for ``last_call``: ``CallStats`` is made from it only when read
    (naming the devices costs more than the rest of the record, on every call)."""

    devices: list[torch.device]
    chunk_sizes: list[int]
    timers: list[Any]
    waves: int


# ``Load`` made from one tuple of its fields in C (``new_load((devices, sizes, timers, 1))``):
# a NamedTuple's own constructor is a Python function, run on every warm call.
new_load: Callable[[tuple[Any, ...]], Load] = partial(tuple.__new__, Load)


def record(state: dict[str, Any], value: CallStats | Load | None) -> None:
    """Record ``value`` as the last call of this thread, in a wrapper's ``__dict__``.

    Called on every forward: straight to the thread-local, past ``nn.Module.__setattr__``.
    One per thread, so threads sharing a wrapper each see their own call.
    """
    calls = state.get("_calls")
    if calls is None:
        calls = state["_calls"] = threading.local()
    calls.last = value


class LastCall:
    """``wrapper.last_call``: the load of this thread's last call through the wrapper
    (``None`` before one); assigning it records the value for this thread."""

    def __init__(self) -> None:
        # help() and the reference show an attribute's own text, not its class's
        self.__doc__ = (
            "The load of this thread's last call through the wrapper, a ``CallStats`` (its\n"
            "devices, chunk sizes, seconds and waves), or ``None`` before a call.\n\n"
            "Each thread sees its own; ``print(w.last_call)`` shows one row per replica."
        )

    @overload
    def __get__(self, wrapper: None, owner: type) -> LastCall: ...

    @overload
    def __get__(self, wrapper: object, owner: type | None = None) -> CallStats | None: ...

    def __get__(self, wrapper: Any, owner: type | None = None) -> LastCall | CallStats | None:
        if wrapper is None:  # read on the class (documentation tools)
            return self
        calls = wrapper.__dict__.get("_calls")
        if calls is None:
            return None
        last = getattr(calls, "last", None)
        if type(last) is Load:  # a call records its load; the stats are made when read
            names = [str(d) for d in last.devices]
            # (a copy of the sizes: a warm call records its step's own list)
            sizes = list(last.chunk_sizes)
            last = calls.last = CallStats(names, sizes, last.timers, last.waves)
        return last

    def __set__(self, wrapper: Any, value: CallStats | None) -> None:
        record(wrapper.__dict__, value)
