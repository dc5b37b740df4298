"""The wrapper's options, checked the one way whether given to the constructor or set later.

``DataParallel(module, ..., scalars="summ")`` is refused at once; so is ``w.scalars = "summ"``
on a built wrapper, which would otherwise silently mean ``"mean"``. Each checked attribute has
one function here, called by ``DataParallel.__setattr__`` (so the constructor, which assigns
them, and later assignments share it). Only assignments pay: the hot path reads the attributes
as plain ones.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dataparallel.devices import check_runnable, resolve_devices, target_device
from dataparallel.gather import check_output_rules, check_scalars
from dataparallel.plan import build_plan
from dataparallel.wrapper._check_option import check_every_option, check_option
from dataparallel.wrapper._peft_class import class_for

__all__ = ["CHECKED", "PLAN_OPTIONS", "check_module", "check_plan_options"]

# The batch options of ``dp.plan``: kept in ``wrapper.options``, read and set as attributes.
PLAN_OPTIONS = ("batch_size", "chunk_sizes", "weights", "max_size", "dtype", "strict")


def check_module(module: Any) -> nn.Module:
    """``module`` must be an ``nn.Module``."""
    if not isinstance(module, nn.Module):
        what = "a function" if callable(module) else type(module).__name__
        raise TypeError(
            f"module: expected a torch.nn.Module, got {what} ({module!r:.60}); wrap a function "
            f"in an nn.Module whose forward calls it"
        )
    return module


def check_dim(dim: Any) -> int:
    """``dim`` must be an int (the batch dimension)."""
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise TypeError(
            f"dim: expected an int (the batch dimension), got {type(dim).__name__} {dim!r:.60}; "
            f"pass e.g. dim=0, or dim=1 for time-major inputs"
        )
    return operator.index(dim)


def check_plan_options(devices: Sequence[torch.device], dim: int, options: dict[str, Any]) -> None:
    """The batch options against the devices, as ``dp.plan`` checks them, with no inputs."""
    strict = options.get("strict", False)
    if not isinstance(strict, bool):
        raise TypeError(
            f"strict: expected True or False, got {type(strict).__name__} {strict!r:.60}; "
            f"strict=True makes an input of another batch size an error instead of a warning"
        )
    probe = dict(options)
    if probe["batch_size"] is None:
        probe["batch_size"] = _probe_batch(probe["chunk_sizes"])
    build_plan((), None, list(devices), dim, **probe)


def _probe_batch(chunk_sizes: Sequence[int] | None) -> int:
    """A batch size that lets the options be validated against the devices."""
    if chunk_sizes is None:
        return 1
    try:
        return max(1, int(sum(chunk_sizes)))
    except TypeError:
        return 1


def check_scalar_weights(scalar_weights: Any) -> Any:
    """``scalar_weights`` must be ``None`` or a function of a chunk's arguments."""
    if scalar_weights is not None and not callable(scalar_weights):
        raise TypeError(
            f"scalar_weights: expected a function (chunk_args, chunk_kwargs) -> number, got "
            f"{type(scalar_weights).__name__}; e.g. lambda a, kw: (kw['labels'] != -100).sum()"
        )
    return scalar_weights


class Wrapper(Protocol):
    """What the checks below read and write of a ``DataParallel``: typed by its shape, so that
    this module, which the wrapper imports, needs nothing of the wrapper's."""

    dim: int
    options: dict[str, Any]
    device_ids: list[torch.device]
    __dict__: dict[str, Any]


# -- assignments on a built wrapper: each returns the value to store ---------------------------


def _set_module(w: Wrapper, value: Any) -> Any:
    # (A module compiled as a whole is refused at the next call, where replicate checks it.)
    check_module(value)
    w.__dict__.pop("_sentinels", None)  # the new module's device is checked in full
    # the class for the new module: a peft model's, or the plain one (``_peft_class``)
    object.__setattr__(w, "__class__", class_for(type(w), value))
    return value


def _set_device_ids(w: Wrapper, value: Any) -> Any:
    devices = resolve_devices(value)
    check_runnable(devices)
    check_plan_options(devices, w.dim, w.options)
    w.__dict__["src_device_obj"] = devices[0]
    w.__dict__.pop("_sentinels", None)
    return devices


def _set_output_device(w: Wrapper, value: Any) -> Any:
    device = target_device(value, where="output_device")
    check_runnable([device], where="output_device", indexed=False)
    return device


def _set_dim(w: Wrapper, value: Any) -> Any:
    dim = check_dim(value)
    check_plan_options(w.device_ids, dim, w.options)
    return dim


CHECKED: dict[str, Callable[[Wrapper, Any], Any]] = {
    "module": _set_module,
    "device_ids": _set_device_ids,
    "output_device": _set_output_device,
    "dim": _set_dim,
    "scalars": lambda w, v: check_scalars(v),
    "scalar_weights": lambda w, v: check_scalar_weights(v),
    "output_rules": lambda w, v: check_output_rules(v),
    "check_mode": lambda w, v: check_option(v),
    "check_every": lambda w, v: check_every_option(v),
}


def plan_option(name: str) -> property:
    """``wrapper.<name>`` for a batch option: read from ``wrapper.options``; set after the
    same check as the constructor's (the new options against the devices)."""

    def get(w: Wrapper) -> Any:
        return w.options[name]

    def set_(w: Wrapper, value: Any) -> None:
        options = {**w.options, name: value}
        check_plan_options(w.device_ids, w.dim, options)
        w.options[name] = value  # in place: one dict, as the plan cache reads it

    return property(get, set_, doc=f"The ``{name}`` batch option (see ``dp.plan``).")
