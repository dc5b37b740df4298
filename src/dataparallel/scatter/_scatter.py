"""``scatter`` and ``scatter_kwargs``: plan the call (a plan kept per call signature), then
``take`` each device's slice."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataparallel._common.warn import warn_user
from dataparallel.devices import DeviceSpec, resolve_devices
from dataparallel.plan import Plan, check_options
from dataparallel.scatter._plans import CallPlans
from dataparallel.scatter._take import take

__all__ = ["emit_warnings", "scatter", "scatter_kwargs"]

# The plans of ``scatter`` and ``scatter_kwargs``: a loop that scatters batches of one signature
# plans them once (a kept plan holds none of a call's values).
_PLANS = CallPlans()


def emit_warnings(plan: Plan) -> None:
    """Warn with the plan's messages (Python's filter shows each once per call site)."""
    for message in plan.warnings:
        warn_user(message)


def _one_round(plan: Plan) -> list[tuple[torch.device, int, int]]:
    return plan.slices[0]


def scatter(
    inputs: Any, devices: DeviceSpec | Sequence[DeviceSpec] | None, dim: int = 0, **opts: Any
) -> list[Any]:
    """Split ``inputs`` over ``devices`` under the batch rules; one entry per device used.

    Each entry is a tuple of arguments when ``inputs`` is a tuple, else that device's chunk.

    >>> import torch, dataparallel as dp
    >>> [c.shape[0] for c in dp.scatter(torch.zeros(10, 2), ["cpu", "cpu", "cpu"])]
    [4, 3, 3]
    """
    check_options(opts)
    p = _PLANS.get(inputs, None, resolve_devices(devices), dim, opts)
    emit_warnings(p)
    return [take(p, start, length, device)[0] for device, start, length in _one_round(p)]


def scatter_kwargs(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: DeviceSpec | Sequence[DeviceSpec] | None,
    dim: int = 0,
    **opts: Any,
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """Split positional and keyword arguments together: per-device args tuples and kwargs.

    Both results have one entry per device used; every device gets every keyword argument.
    ``inputs`` that is not a tuple is taken as one positional argument.
    """
    check_options(opts)
    args = inputs if type(inputs) is tuple else (inputs,)
    p = _PLANS.get(args, kwargs, resolve_devices(devices), dim, opts)
    emit_warnings(p)
    chunks = [take(p, start, length, device) for device, start, length in _one_round(p)]
    return tuple(a for a, _ in chunks), tuple(k for _, k in chunks)
