"""The caller's thread-local state that a replica on a pool worker would otherwise lose.

Replicas 1.. run on pool worker threads (:mod:`dataparallel.parallel_apply`), and much of what
changes a forward's result in torch is per thread. Each kind is handled the one way that gives
the one-device result:

Replayed in the worker (cheap, exact, replicas still overlap):

- grad mode and autocast (by the task itself, :mod:`dataparallel.parallel_apply._task`);
- ``torch.inference_mode()``: the worker enters it too, so in-place ops on inference tensors
  work on every replica as on one device;
- ``torch.set_default_device(d)`` / ``with torch.device(d):`` (torch's ``DeviceContext``
  function modes, when they are the only function modes): the worker enters a ``DeviceContext``
  for the same device;
- ``contextvars``: each worker task runs in a copy of the caller's context
  (``contextvars.copy_context().run``), as ``asyncio.to_thread`` does. Values a replica sets
  there are its own, as a replica's attribute writes are (replica 0's land: it runs on the
  caller's thread).

Run inline, one replica after another on the caller's thread (the result is one device's;
the replicas no longer overlap while the state is active):

- a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ``jvp``, ``functionalize``...):
  its levels live on the calling thread's interpreter stack, and a tensor it wraps is
  meaningless on another thread (zero gradients, or vmap's "tensor escaped" error);
- any other ``TorchFunctionMode`` and every ``TorchDispatchMode`` (``FlopCounterMode``,
  ``FakeTensorMode``, debug and logging modes): a mode object is not made to be entered on
  several threads at once, and a counting mode must see the whole batch;
- ``torch.autograd.graph.saved_tensors_hooks`` (``save_on_cpu``, non-reentrant checkpointing
  around the wrapper): the hooks see every replica's saved tensors in a fixed order, which
  checkpointing's recomputation relies on.

Checking costs eight C-level calls per call (about 0.23 us; bounded in
``tests/parallel_apply/test_thread_state.py``); nothing is captured when none of the above is
active.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._device import DeviceContext

__all__ = ["Replay", "active_state", "must_run_inline", "replay"]

# One C call each, bound once: the hot path looks nothing up by attribute.
_function_modes = torch._C._len_torch_function_stack
_function_mode_at = torch._C._get_function_stack_at
_dispatch_modes = torch._C._len_torch_dispatch_stack
_interpreter = torch._C._functorch.peek_interpreter_stack
_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_inference = torch.is_inference_mode_enabled
copy_context = contextvars.copy_context

# What a worker enters before the replica's forward: context-manager factories.
Replay = tuple[Callable[[], AbstractContextManager[Any]], ...]


def _only_device_contexts() -> bool:
    """True when every function mode on the caller's stack is torch's ``DeviceContext``."""
    return all(type(_function_mode_at(i)) is DeviceContext for i in range(_function_modes()))


def must_run_inline() -> bool:
    """True when the caller's thread holds state a pool worker cannot share: a ``torch.func``
    transform, a dispatch mode, a function mode other than a default device, or saved-tensor
    hooks. The replicas then run one after another on the caller's thread."""
    return (
        _interpreter() is not None
        or _dispatch_modes() > 0
        or _saved_hooks(False) is not None
        or (_function_modes() > 0 and not _only_device_contexts())
    )


def replay() -> Replay:
    """What a worker must enter to run as the caller's thread would (when not inline): the
    inference mode and default-device contexts that are active, else ``()``."""
    found: Replay = ()
    if _inference():
        found += (torch.inference_mode,)
    if _function_modes():  # only DeviceContexts here (else the call runs inline)
        found += tuple(
            functools.partial(DeviceContext, _function_mode_at(i).device)
            for i in range(_function_modes())
        )
    return found


def _mode_name(mode: Any) -> str:
    return type(mode).__name__


def active_state() -> str:
    """The caller's thread state that made the replicas run inline, in words, for errors:
    ``"torch.func transform Vmap (level 1)"``, ``"dispatch mode FlopCounterMode"``...; empty
    when there is none."""
    parts = []
    interpreter = _interpreter()
    if interpreter is not None:
        kind = str(interpreter.key()).rsplit(".", 1)[-1]
        parts.append(f"torch.func transform {kind} (level {interpreter.level()})")
    if _dispatch_modes():
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        names = ", ".join(_mode_name(m) for m in _get_current_dispatch_mode_stack())
        parts.append(f"dispatch mode {names}")
    if _function_modes() and not _only_device_contexts():
        names = ", ".join(_mode_name(_function_mode_at(i)) for i in range(_function_modes()))
        parts.append(f"function mode {names}")
    if _saved_hooks(False) is not None:
        parts.append("saved_tensors_hooks")
    return "; ".join(parts)
