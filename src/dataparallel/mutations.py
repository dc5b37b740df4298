"""A process-wide count of changes made to any ``nn.Module``: the replica cache's cheap check.

Cached replicas must reflect the module on every call: its structure (submodules, parameters,
buffers, hooks, dtypes, devices) and its plain attributes and training flags. Walking every
submodule to find out costs about 1 µs a module per call, and refilling every replica's
``__dict__`` about 2 µs a module per replica. Instead, the change check reads one number.

The number changes whenever a module changes through torch's own mutation paths, which
:func:`install` wraps once per process (thin wrappers that call torch's method, then count):

- ``nn.Module.__setattr__`` and ``__delattr__`` (plain attributes, ``train()``/``eval()``,
  submodules, parameters and buffers assigned as attributes, parametrize's class swap);
- ``register_parameter``, ``register_buffer``, ``add_module`` and ``register_module``;
- ``_apply`` (``.to()``, ``.double()``, ``.cuda()``, ``share_memory()``, ``to_empty()``);
- the forward and backward hook registrations, and ``RemovableHandle.remove`` (a hook removed);
- the container methods that write ``_modules`` directly: ``Sequential.insert``,
  ``ModuleList.insert``, ``ModuleDict.__delitem__`` and ``ModuleDict.clear``.

Writes that bypass all of these (``module.__dict__[k] = v``, ``module._modules[k] = m``,
``module._parameters[k] = p``) are not seen: call ``dp.clear_replica_cache(module)`` after them.
A subclass whose own ``__setattr__`` may not call ``nn.Module.__setattr__`` is not trusted: the
replica cache walks such trees on every call, as it does when another library has replaced a
wrapped method after :func:`install` (:func:`tracking` says so). Values changed in place
(parameters, buffers, a list attribute) need no count: replicas share or re-copy them.

Cost: one extra Python call per wrapped mutation (about 0.15 µs on a ``__setattr__`` that costs
2 µs); ``torch.compile`` traces through the wrappers.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["epoch", "install", "tracking"]

# next() on an itertools.count is atomic under the GIL: every bump stores a value never stored
# before, so a reader that saw one value sees another after any later change.
_COUNTER = itertools.count(1)
_EPOCH = 0
_INSTALL_LOCK = threading.Lock()
# (owner, attribute name, our wrapper), filled by install(); and the same as three tuples
# (names, wrappers, the owners' class dictionaries) for tracking().
_WRAPPED: list[tuple[type, str, Any]] = []
_CHECK: list[tuple[Any, ...]] = []

_MODULE_METHODS = (
    "__delattr__",
    "register_parameter",
    "register_buffer",
    "add_module",
    "register_module",
    "_apply",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_backward_hook",
)
_CONTAINER_METHODS: tuple[tuple[type, str], ...] = (
    (nn.Sequential, "insert"),
    (nn.ModuleList, "insert"),
    (nn.ModuleDict, "__delitem__"),
    (nn.ModuleDict, "clear"),
)


def epoch() -> int:
    """The current count; it differs from any value read before a later module change."""
    return _EPOCH


def _bump() -> None:
    global _EPOCH
    _EPOCH = next(_COUNTER)


def _counting(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` wrapped to count a change once it returns (or raises, half done)."""

    @functools.wraps(method)
    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            _bump()

    return counted


def _counting_setattr(method: Callable[[Any, str, Any], None]) -> Callable[[Any, str, Any], None]:
    """``__setattr__`` wrapped, without ``*args`` (it is the hottest of the paths)."""

    @functools.wraps(method)
    def __setattr__(self: Any, name: str, value: Any) -> None:
        try:
            method(self, name, value)
        finally:
            _bump()

    return __setattr__


def install() -> None:
    """Wrap torch's module mutation paths so that :func:`epoch` moves on every change.

    Idempotent and thread-safe; called by the replica cache before its first entry is made.
    """
    if _WRAPPED:
        return
    with _INSTALL_LOCK:
        if _WRAPPED:
            return
        targets: list[tuple[type, str, Any]] = [
            (nn.Module, "__setattr__", _counting_setattr(nn.Module.__setattr__))
        ]
        targets += [
            (nn.Module, name, _counting(getattr(nn.Module, name))) for name in _MODULE_METHODS
        ]
        targets += [
            (owner, name, _counting(owner.__dict__[name])) for owner, name in _CONTAINER_METHODS
        ]
        targets.append((RemovableHandle, "remove", _counting(RemovableHandle.remove)))
        for owner, name, wrapper in targets:
            setattr(owner, name, wrapper)
        _CHECK.extend(
            (
                tuple(name for _, name, _ in targets),
                tuple(wrapper for _, _, wrapper in targets),
                tuple(owner.__dict__ for owner, _, _ in targets),  # live views
            )
        )
        _WRAPPED.extend(targets)
        _bump()


def tracking() -> bool:
    """Whether every wrapper is installed and still in place (no library replaced one since).

    Called on every cached ``replicate``: the check runs in C (about 1 µs for the 16 names).
    """
    if not _CHECK:
        return False
    names, wrappers, dicts = _CHECK
    return all(map(operator.is_, map(MappingProxyType.get, dicts, names), wrappers))
