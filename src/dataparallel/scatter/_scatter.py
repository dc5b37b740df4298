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

    torch's ``nn.parallel.scatter``, with the batch rules: per-sample lists are split by items,
    unbatched values broadcast, no sample dropped, and CPU lists run.

    Args:
        inputs: a tuple of arguments, or one argument.
        devices: device specs (``["cpu", "cpu"]``, ``[0, 1]``); ``None``: every visible CUDA
            device, else the CPU.
        dim: the batch dimension of tensors and ndarrays.
        **opts: the batch options of ``dp.plan``; one round only, so ``max_size`` must hold
            the whole batch.

    Returns:
        One entry per device used: a tuple of arguments when ``inputs`` is a tuple, else that
        device's chunk, each on its device.

    Raises:
        TypeError: an unknown option.
        ValueError: a bad device spec or option, or arguments the batch rules cannot split,
            as ``dp.plan`` raises them.

    Example:
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

    torch's ``nn.parallel.scatter_kwargs``, with the batch rules: positional and keyword
    arguments vote together for the batch size, and each is split or broadcast by its rule.

    Args:
        inputs: a tuple of positional arguments; anything else is one positional argument.
        kwargs: the keyword arguments, or ``None``.
        devices: device specs; ``None``: every visible CUDA device, else the CPU.
        dim: the batch dimension of tensors and ndarrays.
        **opts: the batch options of ``dp.plan`` (one round: ``max_size`` must hold the batch).

    Returns:
        ``(args, kwargs)``: a tuple of argument tuples and a tuple of keyword dicts, one entry
        per device used; every device gets every keyword argument.

    Raises:
        TypeError: an unknown option.
        ValueError: a bad device spec or option, or arguments the batch rules cannot split.

    Example:
        >>> import torch, dataparallel as dp
        >>> batch = {"mask": torch.ones(5), "scale": 2.0}  # 2.0: not batched, every device's
        >>> args, kws = dp.scatter_kwargs((torch.zeros(5, 2),), batch, ["cpu", "cpu"])
        >>> [a[0].shape[0] for a in args], [(k["mask"].shape[0], k["scale"]) for k in kws]
        ([3, 2], [(3, 2.0), (2, 2.0)])
    """
    check_options(opts)
    args = inputs if type(inputs) is tuple else (inputs,)
    p = _PLANS.get(args, kwargs, resolve_devices(devices), dim, opts)
    emit_warnings(p)
    chunks = [take(p, start, length, device) for device, start, length in _one_round(p)]
    return tuple(a for a, _ in chunks), tuple(k for _, k in chunks)
