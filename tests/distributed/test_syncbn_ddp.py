"""Under an initialised process group, ``nn.SyncBatchNorm`` is torch's own: it synchronises
over the group (GPU tensors only) and dataparallel's replica rendezvous stays out of the way,
inside ``ddp_session`` and inside a ``DataParallel`` run on a rank alike (issue 31)."""

from __future__ import annotations

import json
import os
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


def _ddp_session_worker(out_dir: str) -> None:
    try:  # torch's DDP refuses SyncBatchNorm on CPU modules at construction
        with ddp_session(_model()):
            found = "ran"
    except ValueError as exc:
        found = str(exc)
    rank = int(os.environ["RANK"])
    Path(out_dir, f"ddp_session-{rank}.json").write_text(json.dumps(found))


def _wrapper_worker(out_dir: str) -> None:
    with distributed() as info:
        try:  # a DataParallel on a rank: the layer takes torch's process-group path
            dp.DataParallel(_model(), ["cpu", "cpu"])(torch.randn(4, 4))
            found = "ran"
        except ValueError as exc:
            found = str(exc)
        Path(out_dir, f"DataParallel-{info.rank}.json").write_text(json.dumps(found))


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch refuses CPU tensors only")
def test_torch_process_group_path_is_kept(tmp_path: Path) -> None:
    # Two jobs, each with its own port: a second process group on the port of one just torn
    # down could meet a rank still on the first one's store.
    run_workers(_ddp_session_worker, 2, str(tmp_path))
    run_workers(_wrapper_worker, 2, str(tmp_path))
    for rank in range(2):
        session = json.loads((tmp_path / f"ddp_session-{rank}.json").read_text())
        wrapper = json.loads((tmp_path / f"DataParallel-{rank}.json").read_text())
        assert "SyncBatchNorm layers only work with GPU modules" in session, session
        assert "SyncBatchNorm expected input tensor to be on GPU" in wrapper, wrapper
