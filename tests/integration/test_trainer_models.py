"""transformers' ``Trainer`` handed the wrapper, for the models people train and the settings
they use, at default configs (issue 39): a Llama-style causal LM with gradient accumulation 1
and 2, label smoothing, gradient checkpointing, against the same Trainer run on the plain
model. Each of these read the model Trainer was given (``loss_type``, ``config``,
``activation_checkpointing_enable``): the wrapper reads through to the module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._models import tiny_gpt2, tiny_llama
from ._oracle import LAYOUTS, compare
from .test_trainers import STEPS, _LMRows, _restore_environment, _weights_equal, lm_arguments

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

__all__ = ["_restore_environment"]  # the fixture, used here too

RTOL = 1e-5


def _run(model: nn.Module, out: Path, batch: int, **overrides: Any) -> dict[str, Any]:
    """train, evaluate and predict, all at defaults but for ``overrides``."""
    args = lm_arguments(out, batch, **overrides)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_LMRows(2 * batch), eval_dataset=_LMRows(batch + 2)
    )
    trainer.train()
    return {
        "trainer": trainer,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "metrics": trainer.evaluate(),
        "pred": trainer.predict(_LMRows(batch + 3)),
    }


def _same_as_one_device(
    make: Callable[[], nn.Module], devices: list[str], batch: int, tmp_path: Path, **overrides: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Trainer run on the plain model and on the wrapper: logged losses, eval_loss,
    test_loss, predictions and every trained weight equal (relative 1e-5)."""
    ref_model = make()
    model = copy.deepcopy(ref_model)
    ref = _run(ref_model, tmp_path / "one", batch, **overrides)
    par = _run(dp.DataParallel(model, devices), tmp_path / "par", batch, **overrides)
    assert len(par["losses"]) == STEPS
    assert par["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    assert par["metrics"]["eval_loss"] == pytest.approx(ref["metrics"]["eval_loss"], rel=RTOL)
    test_ref, test_par = ref["pred"].metrics["test_loss"], par["pred"].metrics["test_loss"]
    assert test_par == pytest.approx(test_ref, rel=RTOL)
    want, got = ref["pred"].predictions, par["pred"].predictions
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    assert got.shape == want.shape and got.shape[0] == batch + 3
    compare(torch.from_numpy(want), torch.from_numpy(got), "predictions")
    worst = max(
        ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item()
        for a, b in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True)
    )
    assert worst <= RTOL, f"weights differ by {worst} (relative)"
    _weights_equal(ref_model, model, f"Trainer {make.__name__} {overrides} {devices}")
    return ref, par


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_llama_is_exact(
    devices: list[str], batch: int, accumulation: int, tmp_path: Path
) -> None:
    """Item 1: Trainer counts num_items_in_batch over the shifted labels only when it sees the
    model's loss_type ("ForCausalLM"); it reads it through the wrapper (before: every label
    counted, logged loss 3.258 against 3.910)."""
    ref, par = _same_as_one_device(
        tiny_llama, devices, batch, tmp_path, gradient_accumulation_steps=accumulation
    )
    assert par["trainer"].model.loss_type == "ForCausalLM"
    assert par["trainer"]._loss_shifts_labels and ref["trainer"]._loss_shifts_labels


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_trainer_gpt2_with_label_smoothing(devices: list[str], batch: int, tmp_path: Path) -> None:
    """Item 3: label smoothing reads model.config (before: AttributeError)."""
    _, par = _same_as_one_device(tiny_gpt2, devices, batch, tmp_path, label_smoothing_factor=0.1)
    assert par["trainer"].label_smoother is not None


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_trainer_gpt2_with_gradient_checkpointing(
    devices: list[str], batch: int, tmp_path: Path
) -> None:
    """Item 4: Trainer turns checkpointing on through the model it was given (before:
    AttributeError ... 'gradient_checkpointing_enable')."""
    _, par = _same_as_one_device(tiny_gpt2, devices, batch, tmp_path, gradient_checkpointing=True)
    model = par["trainer"].model.module
    # transformers renamed the flag: is_gradient_checkpointing up to 5.20 (the newest for
    # Python 3.10), is_activation_checkpointing after
    flag = getattr(model, "is_activation_checkpointing", None)
    assert (model.is_gradient_checkpointing if flag is None else flag) is True


def test_trainer_predict_turns_the_cache_off_through_the_wrapper(tmp_path: Path) -> None:
    """Item 2: Trainer writes model.config.use_cache, which is the module's config: predict
    returns logits, not a DynamicCache per replica (before: TypeError in
    _pad_across_processes)."""
    model: Any = tiny_gpt2()
    assert model.config.use_cache  # the default config
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    assert wrapper.config is model.config
    trainer = _run(wrapper, tmp_path, 5)["trainer"]
    assert model.config.use_cache is False and trainer.args.use_cache is False


def test_load_unwrapped_restores_tied_weights(tmp_path: Path) -> None:
    """Item 5: a Trainer checkpoint of GPT-2 written through the wrapper holds the tied
    lm_head.weight once (save_pretrained drops the copy); load_unwrapped restores it through
    the tie, as from_pretrained would (before: Missing key(s) "lm_head.weight"), and is still
    strict about every other key."""
    from safetensors.torch import load_file

    model: Any = tiny_gpt2()
    trainer = _run(dp.DataParallel(model, ["cpu", "cpu"]), tmp_path, 5)["trainer"]
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert "module.lm_head.weight" not in saved and "module.transformer.wte.weight" in saved

    config = model.config
    loaded: Any = dp.load_unwrapped(tmp_path / "saved", type(model)(config))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: not loaded exactly"
    fresh: Any = tiny_gpt2()
    assert not torch.equal(fresh.transformer.wte.weight, model.transformer.wte.weight)

    del saved["module.transformer.ln_f.bias"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*transformer\.ln_f\.bias"):
        dp.load_unwrapped(saved, type(model)(config))
