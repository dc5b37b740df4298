"""``dp.load_unwrapped``: checkpoints written through a wrapper (keys ``module.*``, or a
Lightning module's ``<attribute>.module.*``) load into the plain model, strictly.

Lightning is not installed here: its checkpoint (a dict whose ``state_dict`` holds the
LightningModule's keys) and ``fabric.save``'s (the state's modules turned into their state
dicts) are built in the shapes those libraries write. transformers' ``Trainer`` is tested for
real in ``tests/integration/test_trainers.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dataparallel as dp


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _trained() -> tuple[nn.Module, dp.DataParallel]:
    model = _net(0)
    wrapper = dp.DataParallel(model, ["cpu", "cpu:1"])
    wrapper(torch.randn(6, 4)).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad  # type: ignore[operator]
    return model, wrapper


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_the_wrappers_state_dict_and_a_torch_save_file(tmp_path: Path) -> None:
    model, wrapper = _trained()
    state = wrapper.state_dict()
    assert all(k.startswith("module.") for k in state)
    _same(dp.load_unwrapped(state, _net(1)), model)
    torch.save(state, tmp_path / "w.pt")
    _same(dp.load_unwrapped(tmp_path / "w.pt", _net(1)), model)
    _same(dp.load_unwrapped(str(tmp_path / "w.pt"), _net(1)), model)
    # a plain checkpoint loads too: no prefix
    _same(dp.load_unwrapped(model.state_dict(), _net(1)), model)


class Lit(nn.Module):
    """A LightningModule's shape: the wrapper as an attribute, and a module of its own."""

    def __init__(self, wrapper: nn.Module) -> None:
        super().__init__()
        self.model = wrapper
        self.criterion = nn.CrossEntropyLoss(weight=torch.ones(2))


def test_a_lightning_checkpoint(tmp_path: Path) -> None:
    model, wrapper = _trained()
    lit = Lit(wrapper)
    checkpoint = {
        "epoch": 3,
        "global_step": 30,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": lit.state_dict(),  # model.module.*, criterion.weight
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "lr_schedulers": [],
    }
    assert any(k.startswith("model.module.") for k in checkpoint["state_dict"])
    torch.save(checkpoint, tmp_path / "epoch=3.ckpt")
    _same(dp.load_unwrapped(tmp_path / "epoch=3.ckpt", _net(1)), model)


def test_a_fabric_checkpoint(tmp_path: Path) -> None:
    model, wrapper = _trained()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # fabric.save(path, {"model": wrapper, "optimizer": opt}) writes their state dicts
    torch.save(
        {"model": wrapper.state_dict(), "optimizer": opt.state_dict(), "step": 5},
        tmp_path / "fabric.ckpt",
    )
    _same(dp.load_unwrapped(tmp_path / "fabric.ckpt", _net(1)), model)
    _same(dp.load_unwrapped(tmp_path / "fabric.ckpt", _net(1), key="model"), model)


def test_safetensors_files_and_folders(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model, wrapper = _trained()
    state = {k: v.contiguous() for k, v in wrapper.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    _same(dp.load_unwrapped(tmp_path, _net(1)), model)
    _same(dp.load_unwrapped(tmp_path / "model.safetensors", _net(1)), model)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    keys = sorted(state)
    halves = {"a.safetensors": keys[:3], "b.safetensors": keys[3:]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(sharded / name))
    index = {"weight_map": {k: name for name, part in halves.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    _same(dp.load_unwrapped(sharded, _net(1)), model)


def test_what_does_not_fit_is_an_error(tmp_path: Path) -> None:
    _, wrapper = _trained()
    state = wrapper.state_dict()
    with pytest.raises(RuntimeError, match="Missing key"):
        dp.load_unwrapped({k: v for k, v in state.items() if "2." not in k}, _net(1))
    partial = dp.load_unwrapped(
        {k: v for k, v in state.items() if "2." not in k}, _net(1), strict=False
    )
    assert isinstance(partial, nn.Sequential)
    with pytest.raises(ValueError, match=r"none of its keys .* are Linear's"):
        dp.load_unwrapped(state, nn.Linear(7, 7))
    with pytest.raises(TypeError, match=r"expected the plain module, got a dp.DataParallel"):
        dp.load_unwrapped(state, wrapper)
    with pytest.raises(ValueError, match=r"a 'state_dict' or 'model' entry.*pass key="):
        dp.load_unwrapped({"weights": state, "epoch": 1}, _net(1))
    with pytest.raises(ValueError, match=r"key: 'nope' is not in the checkpoint"):
        dp.load_unwrapped({"model": state}, _net(1), key="nope")
    with pytest.raises(ValueError, match=r"expected a checkpoint folder holding one of"):
        dp.load_unwrapped(tmp_path, _net(1))
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        dp.load_unwrapped(tmp_path / "missing.pt", _net(1))
    torch.save({"model": state, "obj": Lit(nn.Linear(1, 1))}, tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match=r"weights_only=True.*load it yourself"):
        dp.load_unwrapped(tmp_path / "pickled.pt", _net(1))
