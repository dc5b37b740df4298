"""Under an initialised process group, ``nn.SyncBatchNorm`` is torch's own: it synchronises
over the group (GPU tensors only) and dataparallel's replica rendezvous stays out of the way,
inside ``ddp_session`` and inside a ``DataParallel`` run on a rank alike (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.distributed import ddp_session

from ._helpers import distributed, run_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    )


def _errors_worker(out_dir: str) -> None:
    found: dict[str, str] = {}
    try:  # torch's DDP refuses SyncBatchNorm on CPU modules at construction
        with ddp_session(_model()):
            found["ddp_session"] = "ran"
    except ValueError as exc:
        found["ddp_session"] = str(exc)
    with distributed() as info:
        try:  # a DataParallel on a rank: the layer takes torch's process-group path
            dp.DataParallel(_model(), ["cpu", "cpu"])(torch.randn(4, 4))
            found["DataParallel"] = "ran"
        except ValueError as exc:
            found["DataParallel"] = str(exc)
        Path(out_dir, f"{info.rank}.json").write_text(json.dumps(found))


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch refuses CPU tensors only")
def test_torch_process_group_path_is_kept(tmp_path: Path) -> None:
    run_workers(_errors_worker, 2, str(tmp_path))
    for rank in range(2):
        found = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "SyncBatchNorm layers only work with GPU modules" in found["ddp_session"], found
        assert "SyncBatchNorm expected input tensor to be on GPU" in found["DataParallel"], found
