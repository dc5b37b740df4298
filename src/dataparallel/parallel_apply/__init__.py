"""Apply: run each replica on its chunk, replica 0 on the caller's thread, the others on a
process-wide pool of worker threads.

``_apply`` holds the pool and the runs; the caller's thread state that each worker replays
(``_thread_state``), the timers of each run (``_spans``) and ``nn.SyncBatchNorm`` across the
replicas of one call (``_syncbn``: which layers, and when; ``_rendezvous``: where the replicas
meet and exchange their statistics) live beside it.
"""

from __future__ import annotations

from dataparallel.parallel_apply._apply import (
    apply_replicas,
    describe_inputs,
    in_order,
    parallel_apply,
    wait_for,
)

__all__ = ["apply_replicas", "describe_inputs", "in_order", "parallel_apply", "wait_for"]
