"""dataparallel: run one PyTorch module over many devices on one batch, and get the batch right.

>>> import torch, dataparallel as dp
>>> dp.plan((torch.zeros(10, 3), torch.zeros(1, 4)), None, ["cpu", "cpu"]).chunk_sizes
[5, 5]
"""

from __future__ import annotations

from dataparallel.checkpoints import load_unwrapped
from dataparallel.criterion import DataParallelCriterion
from dataparallel.devices import DeviceSpec, resolve_devices
from dataparallel.distributed import (
    DistInfo,
    ShardedSampler,
    ddp_session,
    destroy_distributed,
    gather_all,
    init_distributed,
    shard,
)
from dataparallel.gather import ScalarWeights, gather
from dataparallel.markers import Shared, Split
from dataparallel.parallel_apply import parallel_apply
from dataparallel.plan import Entry, Plan, Vote, plan
from dataparallel.replicate import clear_replica_cache, fresh_replicate, replicate
from dataparallel.scatter import scatter, scatter_kwargs
from dataparallel.wrapper import (
    CallStats,
    DataParallel,
    DeviceOutputs,
    OneDeviceDifference,
    data_parallel,
)

__version__ = "0.1.0"

__all__ = [
    "CallStats",
    "DataParallel",
    "DataParallelCriterion",
    "DeviceOutputs",
    "DeviceSpec",
    "DistInfo",
    "Entry",
    "OneDeviceDifference",
    "Plan",
    "ScalarWeights",
    "ShardedSampler",
    "Shared",
    "Split",
    "Vote",
    "__version__",
    "clear_replica_cache",
    "data_parallel",
    "ddp_session",
    "destroy_distributed",
    "fresh_replicate",
    "gather",
    "gather_all",
    "init_distributed",
    "load_unwrapped",
    "parallel_apply",
    "plan",
    "replicate",
    "resolve_devices",
    "scatter",
    "scatter_kwargs",
    "shard",
]
