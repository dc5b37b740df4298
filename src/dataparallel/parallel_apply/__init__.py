"""Apply: run each replica on its chunk, replica 0 on the caller's thread, the others on a
process-wide pool of worker threads.

``_apply`` holds the entry points (``parallel_apply``, ``apply_replicas``) and picks how a
call's replicas run; ``_pool`` the worker threads (and CUDA side streams) and the hand-off to
them; ``_task`` what one replica's task carries, how it runs and how its failure is re-raised.
The caller's thread state that each worker replays (``_thread_state``), the timers of each run
(``_spans``) and ``nn.SyncBatchNorm`` across the replicas of one call (``_syncbn``: which
layers, and when; ``_rendezvous``: where the replicas meet and exchange their statistics) live
beside them.

Other folders import this stage through this module, never its private modules: ``__all__``
is its interface (``dataparallel`` re-exports the public names).
"""

from __future__ import annotations

from dataparallel.parallel_apply._apply import (
    apply_replicas,
    as_arguments,
    in_order,
    infer_device,
    parallel_apply,
    wait_for,
)
from dataparallel.parallel_apply._reuse import TaskSlots, apply_kept
from dataparallel.parallel_apply._syncbn import batchnorm_note, sync_call
from dataparallel.parallel_apply._task import describe_inputs

__all__ = [
    "TaskSlots",
    "apply_kept",
    "apply_replicas",
    "as_arguments",
    "batchnorm_note",
    "describe_inputs",
    "in_order",
    "infer_device",
    "parallel_apply",
    "sync_call",
    "wait_for",
]
