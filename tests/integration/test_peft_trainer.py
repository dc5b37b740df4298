"""peft under transformers' Trainer, handed the wrapper (issue 49, item 2).

LoRA on a Llama-style causal LM, at Trainer's defaults (``remove_unused_columns=True``, no
``label_names``), against the same Trainer on the peft model itself. Before, the first step
failed: Trainer read the signature of ``PeftModel.forward`` (``*args, **kwargs``) through the
wrapper and dropped every column. What Trainer saves through the wrapper is an adapter with no
tensor (peft filters out the ``module.*`` keys): said once, with the save that works.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._models import text_batch, tiny_llama
from ._oracle import LAYOUTS
from .test_trainers import _restore_environment

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")

__all__ = ["_restore_environment"]  # the fixture, used here too

RTOL = 1e-5


def _lora() -> nn.Module:
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,  # random adapters: a lost one shows
    )
    torch.manual_seed(7)
    return peft.get_peft_model(tiny_llama(), config)


class _Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Tokenized rows with a column the model does not take (Trainer drops it)."""

    def __init__(self, n: int) -> None:
        self.data = text_batch(n, seed=6)
        self.data["idx"] = torch.arange(n)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def _train(model: nn.Module, out: Path, batch: int) -> Any:
    args = transformers.TrainingArguments(  # Trainer's defaults, but for a short SGD run
        output_dir=str(out),
        per_device_train_batch_size=batch,
        max_steps=3,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(2 * batch))
    trainer.train()
    return trainer


def test_the_wrapper_presents_the_base_models_signature() -> None:
    model = _lora()
    names = list(inspect.signature(dp.DataParallel(model, ["cpu", "cpu"]).forward).parameters)
    assert names == list(inspect.signature(model.get_base_model().forward).parameters)
    assert {"input_ids", "attention_mask", "labels"} <= set(names)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_lora_trains_under_trainer_at_its_defaults(
    devices: list[str], batch: int, tmp_path: Path
) -> None:
    ref_model = _lora()
    model = copy.deepcopy(ref_model)
    ref = _train(ref_model, tmp_path / "one", batch)
    par = _train(dp.DataParallel(model, devices), tmp_path / "par", batch)
    losses = [h["loss"] for h in par.state.log_history if "loss" in h]
    assert len(losses) == 3
    assert losses == pytest.approx(
        [h["loss"] for h in ref.state.log_history if "loss" in h], rel=RTOL
    )
    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(trained) == 8
    for name, value in ref_model.state_dict().items():
        got = model.state_dict()[name]
        assert (got - value).abs().max() <= RTOL * value.abs().max().clamp(min=1e-6), name


def test_a_save_through_the_wrapper_is_told_and_the_modules_save_reloads(tmp_path: Path) -> None:
    model = _lora()
    trainer = _train(dp.DataParallel(model, ["cpu", "cpu"]), tmp_path / "run", 5)
    with pytest.warns(UserWarning, match=r"wrapper\.module\.save_pretrained\(dir\)"):
        trainer.save_model(str(tmp_path / "through-the-wrapper"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.model.state_dict()  # said once per wrapper
    trainer.model.module.save_pretrained(str(tmp_path / "adapter"))
    torch.manual_seed(7)
    again = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "adapter"))
    data = text_batch(4, seed=9)
    assert torch.equal(again(**data).logits, model(**data).logits)
