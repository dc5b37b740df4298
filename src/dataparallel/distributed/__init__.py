"""The same batch rules past one machine: torch.distributed, DDP and torchrun.

One process per device, launched by ``torchrun`` (or ``dataparallel train --strategy ddp``):

- :func:`init_distributed` reads torchrun's environment and starts the process group;
- :func:`shard` gives this rank its part of a global batch under the rules of ``dp.scatter``;
- :func:`gather_all` gives every rank everyone's outputs, in rank order, under the rules of
  ``dp.gather``, with uneven sizes exact (nothing padded, nothing duplicated);
- :class:`ShardedSampler` partitions a dataset's indices exactly over the ranks;
- :func:`ddp_session` wraps a module in ``DistributedDataParallel`` and always tears the process
  group down.

Without torchrun's variables everything runs as one process (world size 1, rank 0), so the same
script runs with ``python train.py`` and with ``torchrun --nproc-per-node 4 train.py``.

One job per module: the process and its group (``_process``: ``init_distributed``,
``destroy_distributed``, ``ddp_session``, ``DistInfo``, ``ENV_VARS``, and the rank, world size
and device the others read), meeting the other ranks (``_rendezvous``: the endpoint checked, a
timeout on every wait, torch's errors in our words), cutting a batch by rank (``_shard``),
gathering across ranks (``_gather_all``) and the sampler (``_sampler``).
"""

from __future__ import annotations

from dataparallel.distributed._gather_all import gather_all
from dataparallel.distributed._process import (
    ENV_VARS,
    DistInfo,
    ddp_session,
    destroy_distributed,
    init_distributed,
)
from dataparallel.distributed._rendezvous import resolve_timeout
from dataparallel.distributed._sampler import ShardedSampler
from dataparallel.distributed._shard import shard

__all__ = [
    "ENV_VARS",
    "DistInfo",
    "ShardedSampler",
    "ddp_session",
    "destroy_distributed",
    "gather_all",
    "init_distributed",
    "resolve_timeout",
    "shard",
]
