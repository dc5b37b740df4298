"""peft under transformers' Trainer, handed the wrapper (issue 49, item 2).

LoRA on a Llama-style causal LM, at Trainer's defaults (``remove_unused_columns=True``, no
``label_names``), against the same Trainer on the peft model itself. Before, the first step
failed: Trainer read the signature of ``PeftModel.forward`` (``*args, **kwargs``) through the
wrapper and dropped every column. What Trainer saved through the wrapper (``save_model`` and
its checkpoints) was an adapter with no tensor: peft reads a state dict by its own module names,
and the wrapper's keys were ``module.*``. A wrapped peft model's state dict is now the peft
model's own (the guide's "peft's state dict"): the adapter saves, checkpoints and reloads as
without the wrapper. Trainer tells a peft model by ``isinstance`` only, to resume its adapter
and to read the label names from its base model: the wrapper of a peft model is an instance of
its peft class (``dataparallel.wrapper._peft_class``), so it resumes, loads the best checkpoint
and evaluates with labels as without the wrapper.
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
from _close import assert_close_rel

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


def _train(
    model: nn.Module, out: Path, batch: int, resume: Path | None = None, **options: Any
) -> Any:
    args = transformers.TrainingArguments(  # Trainer's defaults, but for a short SGD run
        output_dir=str(out),
        per_device_train_batch_size=batch,
        max_steps=options.pop("max_steps", 3),
        optim="sgd",
        learning_rate=options.pop("learning_rate", 0.5),
        lr_scheduler_type="constant",
        use_cpu=True,
        save_strategy=options.pop("save_strategy", "no"),
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **options,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Rows(3 * batch), eval_dataset=_Rows(batch + 1)
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
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


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (got - want).abs().max() <= RTOL * want.abs().max().clamp(min=1e-6), what


def test_the_adapter_saves_checkpoints_and_reloads_as_without_the_wrapper(
    tmp_path: Path,
) -> None:
    # Before: an adapter_model.safetensors with no tensor, and from_pretrained loaded the
    # untrained adapter (off by 0.42) with a warning only.
    ref_model, model = _lora(), _lora()
    ref = _train(ref_model, tmp_path / "one", 5, save_strategy="steps", save_steps=1)
    par = _train(
        dp.DataParallel(model, ["cpu", "cpu:1"]),
        tmp_path / "par",
        5,
        save_strategy="steps",
        save_steps=1,
    )
    for name in ("saved", "checkpoint-2", "checkpoint-3"):
        if name == "saved":
            ref.save_model(str(tmp_path / "one" / name))
            par.save_model(str(tmp_path / "par" / name))
        want, got = _adapter(tmp_path / "one" / name), _adapter(tmp_path / "par" / name)
        assert len(want) == 8 and sorted(got) == sorted(want), (name, sorted(got))
        for key, value in want.items():
            _close(got[key], value, f"{name}: {key}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every tensor loads: no missing keys
        torch.manual_seed(7)
        again = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "par" / "saved"))
    data = text_batch(4, seed=9)
    assert torch.equal(again(**data).logits, model(**data).logits)


def test_the_state_dict_is_the_peft_models_and_loads_either_way() -> None:
    model = _lora()
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    state = wrapper.state_dict()
    assert list(state) == list(model.state_dict())  # peft's own keys, as peft's savers read
    again = dp.DataParallel(_lora(), ["cpu", "cpu"])
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    again.load_state_dict(state)
    for name, value in model.state_dict().items():
        assert torch.equal(again.module.state_dict()[name], value), name
    torch_form = nn.DataParallel(model).state_dict()  # module.* keys, as torch writes them
    third = dp.DataParallel(_lora(), ["cpu", "cpu"])
    third.load_state_dict(torch_form)
    for name, value in model.state_dict().items():
        assert torch.equal(third.module.state_dict()[name], value), name

    class Outer(nn.Module):  # held inside a module: torch's keys, saved and loaded alike
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    outer = Outer(wrapper).state_dict()
    assert all(key.startswith("inner.module.") for key in outer)
    Outer(dp.DataParallel(_lora(), ["cpu", "cpu"])).load_state_dict(outer)


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _lora_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    module = model.module if isinstance(model, nn.DataParallel) else model
    return {k: v for k, v in module.state_dict().items() if "lora_" in k}


def test_trainer_resumes_the_adapter_as_without_the_wrapper(tmp_path: Path) -> None:
    # Before: train(resume_from_checkpoint=...) raised "Can't find a checkpoint index":
    # Trainer resumes an adapter only for isinstance(model, PeftModel).
    checkpoints = {"save_strategy": "steps", "save_steps": 1}
    _train(_lora(), tmp_path / "one", 5, **checkpoints)
    _train(dp.DataParallel(_lora(), ["cpu", "cpu:1"]), tmp_path / "par", 5, **checkpoints)
    ref_model = _lora()
    resumed = {"max_steps": 4, **checkpoints}
    ref = _train(ref_model, tmp_path / "one-again", 5, tmp_path / "one" / "checkpoint-2", **resumed)
    wrapper = dp.DataParallel(_lora(), ["cpu", "cpu:1"])
    par = _train(wrapper, tmp_path / "par-again", 5, tmp_path / "par" / "checkpoint-2", **resumed)
    assert len(_losses(par)) == 4  # steps 1 and 2 from the checkpoint's log, 3 and 4 run
    assert _losses(par) == pytest.approx(_losses(ref), rel=RTOL)
    want, got = _lora_weights(ref_model), _lora_weights(wrapper)
    assert len(want) == 8 and sorted(got) == sorted(want)
    for key, value in want.items():
        _close(got[key], value, key)
    untrained = _lora_weights(_lora())
    assert not torch.equal(got[key], untrained[key])  # trained, then resumed


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_trainer_evaluates_and_loads_the_best_adapter_as_without_the_wrapper(
    devices: list[str], batch: int, tmp_path: Path
) -> None:
    # Before: Trainer found no label names through the wrapper (find_labels read
    # DataParallel.forward), so evaluate() gave no eval_loss and load_best_model_at_end found
    # no metric; the best checkpoint's adapter was never loaded.
    options: dict[str, Any] = {
        "eval_strategy": "steps",
        "eval_steps": 1,
        "save_strategy": "steps",
        "save_steps": 1,
        "load_best_model_at_end": True,
        "metric_for_best_model": "loss",
        "learning_rate": 8.0,  # large enough that the last step is not the best
    }
    ref_model = _lora()
    ref = _train(ref_model, tmp_path / "one", batch, **options)
    wrapper = dp.DataParallel(_lora(), devices)
    par = _train(wrapper, tmp_path / "par", batch, **options)
    assert par.label_names == ref.label_names == ["labels"]
    evals = [h["eval_loss"] for h in par.state.log_history if "eval_loss" in h]
    assert len(evals) == 3
    assert evals == pytest.approx(
        [h["eval_loss"] for h in ref.state.log_history if "eval_loss" in h], rel=RTOL
    )
    best = Path(ref.state.best_model_checkpoint).name
    assert best != "checkpoint-3"  # the last step is not the best: loading it shows
    assert par.state.best_model_checkpoint.endswith(best)
    for key, value in _lora_weights(ref_model).items():
        _close(_lora_weights(wrapper)[key], value, key)
    want, got = ref.predict(_Rows(batch + 1)), par.predict(_Rows(batch + 1))
    assert got.label_ids is not None and (got.label_ids == want.label_ids).all()
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=RTOL)


def test_a_peft_models_wrapper_is_an_instance_of_its_class() -> None:
    model = _lora()
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    assert isinstance(wrapper, type(model)) and isinstance(wrapper, nn.DataParallel)
    assert type(wrapper).__name__ == "DataParallel" and isinstance(wrapper, dp.DataParallel)
    assert type(dp.DataParallel(_lora(), ["cpu"])) is type(wrapper)  # one class per peft class
    # peft's names are the module's: read, written and deleted there
    assert wrapper.get_base_model() is model.get_base_model()
    assert wrapper.peft_config is model.peft_config
    configs = dict(model.peft_config)
    wrapper.peft_config = configs  # a property of peft's, with a setter: set on the module
    assert model.peft_config is configs and "peft_config" not in vars(wrapper)
    assert wrapper.save_pretrained.__self__ is model  # the module's, bound to it
    # inspect still reads the constructor on the class
    assert "device_ids" in inspect.signature(type(wrapper)).parameters
    # copies keep the class; a plain module gives the plain class back, and a peft one again
    for again in (copy.deepcopy(wrapper), _pickled(wrapper)):
        assert type(again) is type(wrapper) and again.module is not model
        data = text_batch(4, seed=2)
        # (within rounding: the two chunks' matmuls may round apart from the whole batch's,
        # as transformers 5.24's Llama does, by 1.5e-8 on logits of 0.26)
        assert_close_rel(again(**data).logits, model(**data).logits, msg="logits")
    wrapper.module = nn.Linear(2, 2)
    assert type(wrapper) is dp.DataParallel and not isinstance(wrapper, peft.PeftModel)
    wrapper.module = model
    assert isinstance(wrapper, peft.PeftModel)


def _pickled(module: nn.Module) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_peft_classs_overrides_of_module_methods_never_run_on_the_wrapper() -> None:
    """The method order puts the peft class before ``nn.Module``: a peft override of a module
    method (none in today's peft) would run with the wrapper as ``self``. The wrapper's own
    resolution is in the made class instead, and peft's other names read the module's."""
    model = _lora()

    class Overriding(type(model)):  # type: ignore[misc]
        __module__ = "peft.overriding"  # a peft class, as the wrapper tells them

        def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("peft's override ran")

        def zero_grad(self, set_to_none: bool = True) -> None:
            raise AssertionError("peft's override ran")

        def own_name(self) -> Any:
            return self

    model.__class__ = Overriding
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    assert isinstance(wrapper, Overriding)
    assert all(name.startswith("module.") for name, _ in wrapper.named_parameters())
    wrapper.zero_grad()
    assert wrapper.own_name() is model  # the module's method, bound to the module
    with pytest.raises(AttributeError, match="neither has its module"):
        wrapper.no_such_name  # noqa: B018
    data = text_batch(4, seed=3)
    assert_close = torch.testing.assert_close
    with torch.no_grad():
        assert_close(wrapper(**data).logits, model.get_base_model()(**data).logits)
