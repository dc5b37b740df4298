"""Whether a SyncBatchNorm layer runs inside ``torch.utils.checkpoint``, and what to say.

The recompute of a checkpointed block runs in backward, each replica's on its own, outside
the rendezvous where the replicas meet, so a ``SyncBatchNorm`` inside the block would normalise
each chunk with its own statistics there (reentrant: silently; non-reentrant: torch's
``CheckpointError``). The rendezvous asks :func:`in_checkpoint` at each layer and refuses the
call with :func:`checkpointed`'s message.
"""

from __future__ import annotations

import inspect
import sys
import types

__all__ = ["checkpointed", "in_checkpoint"]


def _checkpoint_codes() -> frozenset[types.CodeType]:
    """The code of ``torch.utils.checkpoint.checkpoint`` (unwrapped: torch decorates it) and of
    the reentrant kind's ``forward``, which code using ``CheckpointFunction.apply`` reaches."""
    from torch.utils import checkpoint as module

    codes = {inspect.unwrap(module.checkpoint).__code__}
    function = getattr(module, "CheckpointFunction", None)
    if function is not None:
        codes.add(function.forward.__code__)
    return frozenset(codes)


_CHECKPOINT_CODES = _checkpoint_codes()


def in_checkpoint(stop: types.CodeType) -> bool:
    """Whether the caller was reached through ``torch.utils.checkpoint``, looking down its
    frames as far as the first one running ``stop`` (the replica's own run: a checkpoint
    around the whole wrapper call is below it, on the caller's side, and recomputes a whole
    call)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code is stop:
            return False
        if code in _CHECKPOINT_CODES:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def checkpointed(name: str) -> str:
    """The refusal for the ``SyncBatchNorm`` layer ``name`` run inside a checkpoint."""
    return (
        f"SyncBatchNorm {name!r} runs inside torch.utils.checkpoint: expected it outside the "
        f"checkpointed block, because the recompute in backward runs each replica's block on "
        f"its own, where the replicas cannot meet, so it would normalise each chunk with its "
        f"own statistics (gradients off, running statistics updated again; use_reentrant=False "
        f"fails in backward with torch's CheckpointError); checkpoint only the layers around "
        f"the SyncBatchNorm, or checkpoint around the whole wrapper call "
        f"(checkpoint(wrapper, x, use_reentrant=True)), or use nn.BatchNorm (per chunk)"
    )
