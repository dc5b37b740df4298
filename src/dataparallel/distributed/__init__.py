"""The same batch rules past one machine: torch.distributed, DDP and torchrun.

The code is in ``_process``, for now (the module ``dataparallel/distributed.py`` moved there
whole, so its history follows it); the next commit splits it by job.
"""

from __future__ import annotations

from dataparallel.distributed._process import (
    ENV_VARS,
    DistInfo,
    ShardedSampler,
    ddp_session,
    destroy_distributed,
    gather_all,
    init_distributed,
    shard,
)

__all__ = [
    "ENV_VARS",
    "DistInfo",
    "ShardedSampler",
    "ddp_session",
    "destroy_distributed",
    "gather_all",
    "init_distributed",
    "shard",
]
