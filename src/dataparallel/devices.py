"""Device specs -> ``torch.device`` lists.

A device spec is an ``int`` (a CUDA index; ``-1`` is the CPU, as in mmcv's device lists and
torch's ``output_device=-1``), a ``str`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``) or a
``torch.device``. Lists may repeat a device: ``["cpu", "cpu"]`` is two replicas
on the CPU, ``[0, 0]`` two replicas on GPU 0. Resolving happens once, up front, so that every
later step works with plain ``torch.device`` objects and every bad spec is reported with its
position in the list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch

__all__ = [
    "DeviceSpec",
    "check_runnable",
    "default_devices",
    "device_type",
    "resolve_device",
    "resolve_devices",
    "target_device",
]

DeviceSpec: TypeAlias = "int | str | torch.device"

_KNOWN_TYPES = ("cpu", "cuda", "mps", "xpu", "meta")
_TYPES: dict[torch.device, str] = {}


def device_type(device: torch.device) -> str:
    """``device.type``, read once per device: torch builds a new string on every read of
    ``.type`` (about 0.25 µs), and the per-call steps ask it of each replica's device.

    >>> device_type(torch.device("cuda", 1)), device_type(torch.device("cpu"))
    ('cuda', 'cpu')
    """
    found = _TYPES.get(device)
    if found is None:
        found = _TYPES[device] = device.type  # a few devices per process: never pruned
    return found


def _fix_hint() -> str:
    if torch.cuda.is_available():
        return f"use 'cpu' or a CUDA index below {torch.cuda.device_count()}"
    return "use 'cpu' (no CUDA device is visible on this machine)"


def resolve_device(spec: DeviceSpec, *, where: str = "device") -> torch.device:
    """Turn one device spec into a ``torch.device`` with an explicit index for CUDA.

    Args:
        spec: an ``int`` CUDA index (``-1``: the CPU), a device string or a ``torch.device``.
        where: the argument path used in error messages.

    Raises:
        ValueError: the spec is not a device, or names a CUDA device this machine lacks.

    >>> resolve_device("cpu"), resolve_device(-1)
    (device(type='cpu'), device(type='cpu'))
    """
    if type(spec) is str and spec == "cpu":  # the common spec, which the steps below accept
        return torch.device("cpu")
    if isinstance(spec, bool):  # bool is an int subclass; True is never a device
        raise ValueError(f"{where}: expected a device such as 'cpu', 'cuda:0' or 0, got {spec!r}")
    if isinstance(spec, int):
        if spec == -1:  # the CPU, as mmcv's device lists and torch's output_device=-1 say
            return torch.device("cpu")
        if spec < 0:
            raise ValueError(
                f"{where}: expected a CUDA index >= 0, got {spec!r}; -1 means the CPU; "
                f"{_fix_hint()}"
            )
        device = torch.device("cuda", spec)
    elif isinstance(spec, torch.device):
        device = spec
    elif isinstance(spec, str):
        try:
            device = torch.device(spec)
        except RuntimeError as exc:
            raise ValueError(
                f"{where}: expected a device such as 'cpu', 'cuda', 'cuda:1' or 'mps', "
                f"got {spec!r}; {_fix_hint()}"
            ) from exc
    else:
        raise ValueError(
            f"{where}: expected an int, a str or a torch.device, got {type(spec).__name__} {spec!r}"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{where}: {spec!r} asks for CUDA, which is not available; {_fix_hint()}"
            )
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{where}: {spec!r} names CUDA device {index}, but only "
                f"{torch.cuda.device_count()} are visible; {_fix_hint()}"
            )
        device = torch.device("cuda", index)
    elif device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(
                f"{where}: {spec!r} asks for MPS, which is not available; {_fix_hint()}"
            )
    elif device.type not in _KNOWN_TYPES:
        raise ValueError(f"{where}: device type {device.type!r} is not supported; {_fix_hint()}")
    return device


def default_devices() -> list[torch.device]:
    """Every visible CUDA device, else the CPU alone."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def resolve_devices(
    specs: DeviceSpec | Sequence[DeviceSpec] | None, *, where: str = "device_ids"
) -> list[torch.device]:
    """Turn a device list (or one spec, or ``None``) into a list of ``torch.device``.

    ``None`` means every visible CUDA device, else ``["cpu"]``. Repeats are kept: each entry is
    one replica. Every function that takes devices resolves them so.

    Args:
        specs: a device spec (an ``int`` CUDA index, ``-1`` the CPU; a string such as ``"cpu"``
            or ``"cuda:1"``; a ``torch.device``), a list of them, or ``None``.
        where: the argument path the error messages name.

    Returns:
        One ``torch.device`` per entry, CUDA ones with their index.

    Raises:
        TypeError: a set or mapping (no order, no repeats) where a list is meant.
        ValueError: the list is empty, or an entry is not a usable device (the message names
            its position, e.g. ``device_ids[1]``).

    Example:
        >>> import dataparallel as dp
        >>> dp.resolve_devices(["cpu", "cpu"])
        [device(type='cpu'), device(type='cpu')]
        >>> dp.resolve_devices(-1)
        [device(type='cpu')]
    """
    if specs is None:
        return default_devices()
    if (
        type(specs) is list
        and specs
        and all(type(s) is torch.device and s in _RESOLVED for s in specs)
    ):
        # Devices this function returned before resolve to themselves: the pipeline passes
        # its resolved list on to replicate and parallel_apply on every call.
        return list(specs)
    if isinstance(specs, str) and "," in specs:
        # "cpu,cpu" as typed on a command line: one string, where a list is meant
        suggested: list[int | str] = [
            int(part.strip()) if part.strip().isdigit() else part.strip()
            for part in specs.split(",")
        ]
        raise ValueError(
            f"{where}: expected a list of devices, got the string {specs!r}; "
            f"pass {where}={suggested!r}"
        )
    if isinstance(specs, (int, str, torch.device)):
        return [resolve_device(specs, where=where)]
    if isinstance(specs, (set, frozenset, Mapping)):
        raise TypeError(
            f"{where}: expected a list of devices, got a {type(specs).__name__}, which has no "
            f"order and no repeats (one entry is one replica); pass a list such as "
            f"['cpu', 'cpu'] or [0, 1]"
        )
    items = list(specs)
    if not items:
        raise ValueError(
            f"{where}: expected at least one device, got an empty list; pass e.g. ['cpu'] or "
            f"[0, 1], or None for every visible device"
        )
    resolved = [resolve_device(spec, where=f"{where}[{i}]") for i, spec in enumerate(items)]
    _RESOLVED.update(resolved)
    return resolved


# Devices resolve_devices has returned: resolving one again gives it back unchanged (a CUDA
# device carries its checked index), so a list of them needs no second check.
_RESOLVED: set[torch.device] = set()


# torch.device objects already checked by target_device: a gather runs on every forward call,
# and checking the same device again each time costs more than the rest of a small gather.
_CHECKED: set[torch.device] = set()


def target_device(spec: DeviceSpec | None, *, where: str = "target_device") -> torch.device:
    """The device a gather lands on: ``-1`` and ``"cpu"`` mean the CPU, as in torch."""
    if type(spec) is torch.device and spec in _CHECKED:
        return spec
    if spec is None or (isinstance(spec, int) and not isinstance(spec, bool) and spec == -1):
        return torch.device("cpu")
    device = resolve_device(spec, where=where)
    if type(spec) is torch.device and device == spec:
        _CHECKED.add(device)
    return device


def check_runnable(
    devices: Sequence[torch.device], *, where: str = "device_ids", indexed: bool = True
) -> None:
    """Refuse devices that cannot run a module: ``meta`` tensors hold no data.

    ``dp.plan``, ``explain`` and ``replicate`` accept them (they run nothing); running on them
    would fail deep inside torch.
    """
    for i, device in enumerate(devices):
        if device.type == "meta":
            name = f"{where}[{i}]" if indexed else where
            raise ValueError(
                f"{name}: the meta device holds no data, expected a device that computes "
                f"('cpu', 'cuda:0'); pass real devices, or use dp.plan(...) or explain(...) to "
                f"see the plan without running"
            )
