"""When a wrapper's call may go straight to ``forward``: ``nn.Module.__call__`` without the
checks torch's ``_call_impl`` makes on every call, for the calls where they find nothing.

torch's ``_call_impl`` looks up the tracing state, the module's four hook tables and the four
global ones, then calls ``forward``; on a warm call that is a few µs of Python each time, after
a forward has swept the caches. ``DataParallel.__call__`` asks ``direct_call`` first and runs
torch's own ``__call__`` whenever the answer is no (a hook on the wrapper, a global module hook,
``torch.jit.trace``, a wrapper compiled in place with ``w.compile()``), so hooks, tracing and
compilation behave exactly as torch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.modules.module as _torch_module

__all__ = ["direct_call"]

_tracing = torch._C._get_tracing_state


def direct_call(d: dict[str, Any]) -> bool:
    """Whether ``_call_impl`` would call ``forward`` directly for a module whose ``__dict__`` is
    ``d``: not compiled in place, no hook of its own or global, not traced."""
    return (
        d.get("_compiled_call_impl") is None
        and not (
            d.get("_forward_hooks")
            or d.get("_forward_pre_hooks")
            or d.get("_backward_hooks")
            or d.get("_backward_pre_hooks")
        )
        and not (
            _torch_module._global_forward_hooks
            or _torch_module._global_forward_pre_hooks
            or _torch_module._global_backward_hooks
            or _torch_module._global_backward_pre_hooks
        )
        and not _tracing()
    )
