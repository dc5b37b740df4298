"""``dataparallel train --batchnorm`` and ``--sync-bn``: the tutorial net's variant with
BatchNorm, per chunk or synchronised over the replicas (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dataparallel.app.cli import main
from dataparallel.app.demo.checkpoint import load_checkpoint
from dataparallel.app.demo.data import load_dataset
from dataparallel.app.demo.models import build_model

ARGV = ["train", "--devices", "cpu,cpu", "--epochs", "1", "--lr", "0.05", "--seed", "3"]


def _one_device_epoch() -> tuple[float, dict[str, torch.Tensor]]:
    """The oracle: the BatchNorm variant trained in plain PyTorch on one device, one epoch."""
    data = load_dataset("digits")
    torch.manual_seed(3)
    net = build_model(data.input_shape, 10, batchnorm="chunk")
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    order = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(3))
    total = 0.0
    for start in range(0, len(order), 32):
        idx = order[start : start + 32]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(data.train_x[idx]), data.train_y[idx])
        loss.backward()
        opt.step()
        total += loss.item() * len(idx)
    return total / len(order), net.state_dict()


def test_sync_bn_trains_as_one_device_and_per_chunk_batchnorm_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loss, state = _one_device_epoch()
    figures = {}
    for flag in ("--sync-bn", "--batchnorm"):
        ckpt, out = tmp_path / f"{flag}.pt", tmp_path / f"{flag}.json"
        code = main([*ARGV, flag, "--checkpoint", str(ckpt), "--json", str(out)])
        assert code == 0, capsys.readouterr().err
        figures[flag] = (json.loads(out.read_text()), load_checkpoint(ckpt)["model"])
    synced, synced_state = figures["--sync-bn"]
    assert synced["history"][0]["loss"] == pytest.approx(loss, rel=1e-4)
    assert synced_state.keys() == state.keys()  # SyncBatchNorm keeps BatchNorm's keys
    for key, value in state.items():
        assert torch.allclose(synced_state[key].float(), value.float(), atol=1e-4), key
    per_chunk = figures["--batchnorm"][0]
    assert abs(per_chunk["history"][0]["loss"] - loss) > 1e-3 * loss


def test_batchnorm_and_sync_bn_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGV, "--batchnorm", "--sync-bn"]) == 2
    assert "not allowed with argument --batchnorm" in capsys.readouterr().err


def test_sync_bn_under_ddp_on_cpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # --devices cpu: the CPU on any machine (without it, a machine without a GPU)
    argv = ["train", "--strategy", "ddp", "--nproc-per-node", "2", "--devices", "cpu"]
    code = main([*argv, "--sync-bn"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--sync-bn" in err and "--strategy dp --devices cpu,cpu" in err


def test_resume_with_another_batchnorm_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "c.pt"
    base = ["train", "--data", "random", "--checkpoint", str(ckpt)]
    assert main([*base, "--sync-bn"]) == 0
    capsys.readouterr()
    code = main([*base, "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "--batchnorm 'sync'" in err
