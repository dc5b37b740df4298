"""torch.compile in both orders, and a LoRA (peft) model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._models import text_batch, tiny_bert
from ._oracle import LAYOUTS, check


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _sq(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.mark.parametrize("backend", ["aot_eager"])  # its backward runs AOT-traced graphs
def test_compile_option_compiles_every_replica(backend: str) -> None:
    torch._dynamo.reset()
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))

    def compiled(module: nn.Module, devices: list[str]) -> Any:
        return dp.DataParallel(module, devices, compile={"backend": backend})

    check(
        f"DataParallel(compile=) {backend}",
        _mlp(),
        (x,),
        {},
        _sq,
        ["cpu", "cpu:1", "cpu:1"],
        wrap=compiled,
    )


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiling_the_wrapper_runs_it_eagerly_with_one_warning(backend: str) -> None:
    """torch.compile(wrapper) cannot trace the pipeline (locks, threads): the wrapper runs
    eagerly, right, and says once to use compile= instead."""
    torch._dynamo.reset()
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))

    def compiled(module: nn.Module, devices: list[str]) -> Any:
        return torch.compile(dp.DataParallel(module, devices), backend=backend)

    with pytest.warns(UserWarning, match=r"compiles none of the model") as rec:
        check(
            f"torch.compile(DataParallel) {backend}",
            _mlp(),
            (x,),
            {},
            _sq,
            ["cpu", "cpu:1", "cpu:1"],
            wrap=compiled,
        )
    assert not [w for w in rec if "Dynamo" in str(w.message)]


def test_wrapping_a_compiled_module_fails_at_once_saying_what_to_do() -> None:
    compiled = torch.compile(_mlp(), backend="eager")
    with pytest.raises(TypeError, match=r"dp.DataParallel\(model, devices, compile=True\)"):
        dp.DataParallel(compiled, ["cpu", "cpu"])
    in_place = _mlp()
    in_place.compile(backend="eager")
    with pytest.raises(TypeError, match=r"module\.compile\(\)"):
        dp.data_parallel(in_place, torch.randn(4, 6), ["cpu", "cpu"])
    # one replica is the module itself, compiled forward and all
    out = dp.DataParallel(compiled, ["cpu"])(torch.randn(4, 6))
    assert out.shape == (4, 3)


peft = pytest.importorskip("peft", reason="peft is not installed")


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_lora_on_bert_trains_only_the_adapter(devices: list[str], batch: int) -> None:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, target_modules=["query", "value"], lora_dropout=0.0, init_lora_weights=False
    )
    model = get_peft_model(tiny_bert(), config)
    before = copy.deepcopy(model.state_dict())
    data = text_batch(batch, seed=4)
    data["labels"] = torch.arange(batch) % 3
    _, par = check("peft LoRA bert", model, (), data, lambda out: out.loss, devices)
    trained = {n for n, p in par.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    for name, value in par.state_dict().items():
        assert torch.equal(value, before[name]) == ("lora_" not in name), name
