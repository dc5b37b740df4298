"""What synchronised BatchNorm costs: a training step of the tutorial-sized CNN with
``nn.SyncBatchNorm`` on two CPU replicas, against the same net with plain ``nn.BatchNorm*``
(each chunk normalised on its own, torch's DataParallel behaviour) on the same replicas."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import Case, Settings, compare, paired_ratio
from dataparallel.app.demo.models import Net
from dataparallel.wrapper import DataParallel

__all__ = ["case_syncbn"]


def case_syncbn(settings: Settings) -> list[Case]:
    """One SGD step of ``Net(3, 32, 10, batchnorm=True)`` at batch 32 on ``["cpu", "cpu"]``:
    SyncBatchNorm (whole-batch statistics) vs BatchNorm (per chunk)."""
    torch.manual_seed(0)
    per_chunk = Net(3, 32, 10, batchnorm=True)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(per_chunk))
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))

    def stepper(module: nn.Module) -> Callable[[], None]:
        model = DataParallel(module, ["cpu", "cpu"])
        opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return step

    stats = compare({"SyncBatchNorm": stepper(synced), "BatchNorm": stepper(per_chunk)}, settings)
    ratio, of_medians = paired_ratio(stats["SyncBatchNorm"], stats["BatchNorm"])
    return [
        Case(
            "syncbn_2x_train_step",
            "training step (fwd, loss, bwd, SGD) of Net(3, 32, 10) with 4 BatchNorm layers, "
            "batch 32 on ['cpu', 'cpu']: nn.SyncBatchNorm (whole-batch statistics) vs "
            "nn.BatchNorm (per chunk)",
            "BatchNorm",
            "SyncBatchNorm",
            stats,
            ratio,
            of_medians,
            "synchronised step time / per-chunk step time",
            "<=",
            None,
            extra={"replicas": 2, "batchnorm_layers": 4},
        )
    ]
