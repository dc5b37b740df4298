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

    torch's ``nn.parallel.data_parallel``, with the batch rules: the replicas are kept between
    calls on the same module (``dp.clear_replica_cache`` frees them), and calls on one module
    from several threads take turns, as through one wrapper.

    Args:
        module: the module to run; its parameters and buffers must be on ``device_ids[0]``.
        inputs: the tuple of positional arguments for ``forward``, or one argument (``None``:
            none).
        device_ids: device specs, as for ``DataParallel``; ``None``: every visible CUDA
            device, else the CPU.
        output_device: where the output lands (``-1``: the CPU); default ``device_ids[0]``.
        dim: the batch dimension.
        module_kwargs: keyword arguments for ``forward``, split by the same rules.
        **opts: ``DataParallel``'s keyword options (``batch_size``, ``scalars``, ...).

    Returns:
        The module's output, gathered on ``output_device``.

    Raises:
        TypeError: ``module_kwargs`` is not a mapping, or an argument ``DataParallel`` checks
            has the wrong type.
        ValueError: a device spec or option ``DataParallel`` refuses, or arguments the batch
            rules cannot split; the message names the argument and the fix.

    Example:
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
