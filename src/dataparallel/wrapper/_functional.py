"""``data_parallel``: the functional form of ``DataParallel``, one call at a time.

Each call makes a wrapper whose replicas live in ``dp.replicate``'s process-wide table (the
wrapper's own would die with it), and whose lock is the module's: calls on one module from
several threads (a training thread and an evaluation thread) take turns, as through one wrapper.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from dataparallel.devices import DeviceSpec
from dataparallel.replicate import ReplicaSets
from dataparallel.wrapper._data_parallel import DataParallel

__all__ = ["data_parallel"]


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: DeviceSpec | Sequence[DeviceSpec] | None = None,
    output_device: DeviceSpec | None = None,
    dim: int = 0,
    module_kwargs: Mapping[str, Any] | None = None,
    **opts: Any,
) -> Any:
    """The functional form of ``DataParallel``: one call, same rules, cached replicas.

    ``inputs`` is the tuple of positional arguments, or one argument; ``output_device=-1``
    means the CPU. ``opts`` are ``DataParallel``'s keyword options.

    >>> import torch, dataparallel as dp
    >>> out = dp.data_parallel(torch.nn.Linear(4, 2), torch.randn(8, 4), ["cpu", "cpu"], -1)
    >>> out.shape, out.device.type
    (torch.Size([8, 2]), 'cpu')
    """
    # None means no inputs, as in torch (a forward that takes none)
    args = inputs if type(inputs) is tuple else () if inputs is None else (inputs,)
    if module_kwargs is not None and not isinstance(module_kwargs, Mapping):
        raise TypeError(
            f"module_kwargs: expected a dict of keyword arguments for forward, got "
            f"{type(module_kwargs).__name__} {module_kwargs!r:.60}; pass e.g. {{'mask': mask}}, "
            f"or put positional arguments in inputs as a tuple"
        )
    wrapper = DataParallel(module, device_ids, output_device, dim, **opts)
    # One wrapper per call: the replicas live in dp.replicate's table, reused across calls,
    # so every call on this module takes the module's one lock (a training thread and an
    # evaluation thread take turns, as through one wrapper).
    wrapper.__dict__["_replica_sets"] = ReplicaSets(shared=True)
    wrapper.__dict__["_lock"] = _module_lock(module)
    return wrapper(*args, **(module_kwargs or {}))


_MODULE_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_MODULE_LOCKS_LOCK = threading.Lock()


def _module_lock(module: nn.Module) -> threading.RLock:
    """The call lock ``data_parallel`` shares for ``module`` (held weakly, made on first use)."""
    try:
        with _MODULE_LOCKS_LOCK:
            lock = _MODULE_LOCKS.get(module)
            if lock is None:
                lock = _MODULE_LOCKS[module] = threading.RLock()
            return lock
    except TypeError:  # an unhashable module class: fresh replicas per call, nothing shared
        return threading.RLock()
