"""``torch.compile`` and DataParallel: which order works, and a clear error for the other.

``torch.compile(model)`` returns an ``OptimizedModule`` whose ``forward`` is a compiled
function bound to the original ``model``; ``model.compile()`` stores one bound the same way.
A replica copies that binding, so every replica would run the original module: on one device
all of them would write its buffers at once, on other devices its parameters would be in the
wrong place. So ``DataParallel`` refuses such a module on more than one replica, at once, and
says what works instead: compile the wrapper, ``torch.compile(dp.DataParallel(model))``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["check_not_compiled", "compiled_class"]


def compiled_class() -> type | None:
    """``torch.compile``'s module wrapper class (``OptimizedModule``), where torch has one.

    ``None`` while dynamo is not imported: then nothing can have been compiled, and importing
    it here (about a second) would only find that out.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def check_not_compiled(module: nn.Module, devices: Sequence[torch.device]) -> None:
    """Raise when ``module`` was compiled as a whole and would be replicated.

    Raises:
        TypeError: ``module`` is a ``torch.compile`` result, or was compiled in place with
            ``module.compile()``, and ``devices`` holds more than one replica.
    """
    if len(devices) < 2:
        return  # one replica is the module itself: its compiled forward is right
    compiled = compiled_class()
    if compiled is not None and isinstance(module, compiled):
        found = "a torch.compile(...) result (OptimizedModule)"
    elif module.__dict__.get("_compiled_call_impl") is not None:
        found = "a module compiled in place with module.compile()"
    else:
        return
    raise TypeError(
        f"module: expected an eager module to replicate over {len(devices)} replicas, got "
        f"{found}: its compiled forward is bound to the original module, so every replica "
        f"would run that one module (racing on its buffers, or on the wrong device); fix: "
        f"compile the wrapper instead, torch.compile(dp.DataParallel(model)), or pass the "
        f"eager model (torch.compile(model)._orig_mod)"
    )
