"""Inside the trainers users already have: transformers' ``Trainer``, accelerate's
``Accelerator``, and plain ``torch.save`` round trips, each against the same run on one device.

The model is the tiny BERT of ``_models`` (dropout off, random weights, nothing downloaded). The
optimizer is SGD at a constant rate, so a difference in the gradients shows in the weights as
it is, not rescaled by Adam's normalisation.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._models import text_batch, tiny_bert
from ._oracle import LAYOUTS, compare, record

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")

STEPS = 3


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """TrainingArguments and Accelerator write settings into os.environ (the mixed precision
    mode, the device): put it back, so the suite's leak check sees what it saw before."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class _Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows as a tokenizer and a datasets map would give them: the model's inputs, a label,
    and a column the model does not take (Trainer must drop it, reading the signature)."""

    def __init__(self, n: int, seed: int) -> None:
        data = text_batch(n, seed=seed)
        data["labels"] = torch.arange(n) % 3
        data["idx"] = torch.arange(n)  # not a parameter of forward
        self.data, self.n = data, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def _trainer(model: nn.Module, out: Path, batch: int, **overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        # Trainer reads label names from the model's class: a wrapper's class has none
        label_names=["labels"],
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    args = transformers.TrainingArguments(**{**settings, **overrides})
    return transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_Rows(2 * batch, seed=0),  # two epochs in three steps: a reshuffle
        eval_dataset=_Rows(batch + 2, seed=1),  # an uneven last batch
    )


def _run(model: nn.Module, out: Path, batch: int) -> dict[str, Any]:
    trainer = _trainer(model, out, batch)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    pred = trainer.predict(_Rows(batch + 3, seed=2))
    trainer.save_model(str(out / "saved"))
    return {"trainer": trainer, "losses": losses, "metrics": metrics, "pred": pred}


def _weights_equal(ref: nn.Module, other: nn.Module, case: str) -> float:
    """Every entry of the state dicts (same keys, no prefix): the largest difference."""
    a, b = ref.state_dict(), other.state_dict()
    assert list(a) == list(b)
    worst = max(compare(a[k], b[k], k) for k in a)
    record(case, worst)
    return worst


def test_the_wrapper_presents_the_module_signature() -> None:
    model = tiny_bert()
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    expected = inspect.signature(model.forward)
    assert inspect.signature(wrapper.forward) == expected
    assert inspect.signature(wrapper) == expected
    assert "input_ids" in inspect.signature(wrapper.forward).parameters


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_trainer_end_to_end(devices: list[str], batch: int, tmp_path: Path) -> None:
    """train, evaluate, predict through Trainer(model=dp.DataParallel(...)) equal the one-device
    Trainer; the module saved with save_pretrained loads exactly with from_pretrained."""
    ref_model = tiny_bert()
    model = copy.deepcopy(ref_model)
    ref = _run(ref_model, tmp_path / "one", batch)
    par = _run(dp.DataParallel(model, devices), tmp_path / "par", batch)

    assert len(par["losses"]) == STEPS
    assert par["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert par["metrics"]["eval_loss"] == pytest.approx(ref["metrics"]["eval_loss"], abs=1e-5)
    for field in ("predictions", "label_ids"):  # numpy arrays, batch order kept
        want, got = getattr(ref["pred"], field), getattr(par["pred"], field)
        assert got.shape == want.shape == (batch + 3, *want.shape[1:])
        compare(torch.from_numpy(want), torch.from_numpy(got), field)
    _weights_equal(ref_model, model, f"Trainer {devices}")

    # The recipe: save the module (the model Trainer was given, inside the wrapper).
    par["trainer"].model.module.save_pretrained(tmp_path / "module")
    cls = type(model)
    loaded = cls.from_pretrained(tmp_path / "module")
    _weights_equal(ref_model, loaded, f"Trainer {devices} from_pretrained")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: not loaded exactly"


def test_trainer_save_model_writes_the_wrappers_keys(tmp_path: Path) -> None:
    """trainer.save_model() saves Trainer.model.state_dict(): with the wrapper as the model,
    its keys are module.*, as with torch's nn.DataParallel. They load back into a wrapper, not
    into the plain model: the README's recipe saves the module instead."""
    from safetensors.torch import load_file

    model = tiny_bert()
    trainer = _trainer(dp.DataParallel(model, ["cpu", "cpu"]), tmp_path, 5)
    trainer.save_model(str(tmp_path / "saved"))
    state = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert state and all(k.startswith("module.") for k in state)
    again = dp.DataParallel(tiny_bert(num_labels=3), ["cpu", "cpu"])
    again.load_state_dict(state)
    _weights_equal(model, again.module, "Trainer.save_model into a wrapper")


def test_trainer_checkpoints_load_into_the_plain_model_with_load_unwrapped(
    tmp_path: Path,
) -> None:
    """Trainer's checkpoint-N folders and save_model hold module.* keys; from_pretrained
    re-initialises every weight without an error; dp.load_unwrapped loads them exactly."""
    ref_model = tiny_bert()
    model = copy.deepcopy(ref_model)
    trainer = _trainer(
        dp.DataParallel(model, ["cpu", "cpu:1"]),
        tmp_path,
        5,
        save_strategy="steps",
        save_steps=STEPS,
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    cls, config = type(model), model.config  # type: ignore[union-attr]

    naive = cls.from_pretrained(tmp_path / "saved")  # what users do, and what goes wrong
    assert not torch.equal(naive.classifier.weight, model.classifier.weight)  # type: ignore[union-attr]

    for folder in (tmp_path / "saved", tmp_path / f"checkpoint-{STEPS}"):
        loaded = dp.load_unwrapped(folder, cls(config))
        for (name, a), b in zip(
            model.state_dict().items(), loaded.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), f"{folder.name}: {name}"
    # a trained model, not the initial one
    assert not torch.equal(ref_model.classifier.weight, model.classifier.weight)  # type: ignore[union-attr]


def _accelerate_run(
    model: nn.Module, devices: list[str] | None, batch: int
) -> tuple[Any, nn.Module, list[float]]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    run = dp.DataParallel(model, devices) if devices else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = text_batch(batch, seed=4)
    data["labels"] = torch.arange(batch) % 3
    prepared, opt = accelerator.prepare(run, opt)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = prepared(**data).loss
        accelerator.backward(loss)
        opt.step()
        losses.append(loss.item())
    return accelerator, prepared, losses


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_accelerate_prepare_and_train(devices: list[str], batch: int, tmp_path: Path) -> None:
    """Accelerator.prepare keeps the wrapper; training through it equals one device; the
    module saved by accelerator.save_model(wrapper.module) loads into the plain model."""
    from safetensors.torch import load_file

    ref_model = tiny_bert()
    model = copy.deepcopy(ref_model)
    _, _, ref_losses = _accelerate_run(ref_model, None, batch)
    accelerator, prepared, losses = _accelerate_run(model, devices, batch)
    assert isinstance(prepared, dp.DataParallel) and prepared.module is model
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    _weights_equal(ref_model, model, f"accelerate {devices}")

    accelerator.save_model(prepared.module, tmp_path / "acc")
    plain = tiny_bert()
    plain.load_state_dict(load_file(str(tmp_path / "acc" / "model.safetensors")))
    _weights_equal(ref_model, plain, f"accelerate {devices} save_model")


def test_accelerate_unwraps_the_wrapper(tmp_path: Path) -> None:
    """unwrap_model and save_model find .module through isinstance(m, nn.DataParallel)."""
    from safetensors.torch import load_file

    model = tiny_bert()
    accelerator, prepared, _ = _accelerate_run(model, ["cpu", "cpu"], 5)
    assert accelerator.unwrap_model(prepared) is model
    accelerator.save_model(prepared, tmp_path / "acc")
    state = load_file(str(tmp_path / "acc" / "model.safetensors"))
    assert not any(k.startswith("module.") for k in state)


def test_torch_save_round_trips(tmp_path: Path) -> None:
    """torch.save(wrapper.module.state_dict()) loads into the plain model; the wrapper's own
    state_dict (module.* keys, as torch's) loads into a wrapper; both exactly."""
    model = tiny_bert()
    wrapper = dp.DataParallel(model, ["cpu", "cpu:1", "cpu:1"])
    data = text_batch(7, seed=5)
    data["labels"] = torch.arange(7) % 3
    wrapper(**data).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad  # type: ignore[operator]

    torch.save(wrapper.module.state_dict(), tmp_path / "module.pt")
    plain = tiny_bert()
    plain.load_state_dict(torch.load(tmp_path / "module.pt", weights_only=True))
    _weights_equal(model, plain, "torch.save module")

    torch.save(wrapper.state_dict(), tmp_path / "wrapper.pt")
    state = torch.load(tmp_path / "wrapper.pt", weights_only=True)
    assert all(k.startswith("module.") for k in state)
    again = dp.DataParallel(tiny_bert(), ["cpu", "cpu"])
    again.load_state_dict(state)
    _weights_equal(model, again.module, "torch.save wrapper")
    assert again(**data).loss.item() == pytest.approx(wrapper(**data).loss.item(), abs=1e-6)


class _LMRows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Language-model rows with right padding labelled -100: chunks hold different numbers of
    labelled tokens."""

    def __init__(self, n: int) -> None:
        self.data, self.n = text_batch(n, seed=6), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_trainer_token_loss_with_num_items_in_batch(
    devices: list[str], batch: int, tmp_path: Path
) -> None:
    """A causal LM under Trainer: Trainer passes num_items_in_batch (the forward takes
    **kwargs), each chunk's loss is its token sum over the global count, so scalars="sum"
    makes the step the one-device step."""
    from ._models import tiny_gpt2

    def run(model: nn.Module, out: Path) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=batch,
            max_steps=2,
            optim="sgd",
            learning_rate=0.5,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            use_cpu=True,
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_LMRows(batch))
        assert trainer.model_accepts_loss_kwargs
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ref_model = tiny_gpt2()
    model = copy.deepcopy(ref_model)
    ref = run(ref_model, tmp_path / "one")
    par = run(dp.DataParallel(model, devices, scalars="sum"), tmp_path / "par")
    assert par == pytest.approx(ref, abs=1e-5)
    _weights_equal(ref_model, model, f"Trainer gpt2 num_items_in_batch {devices}")


def lm_arguments(out: Path, batch: int, **overrides: Any) -> Any:
    """The TrainingArguments of the causal-LM runs: SGD at a constant rate, one log line per
    step, nothing saved, on the CPU; ``overrides`` replace any of them."""
    settings: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        label_names=["labels"],  # a wrapper's class names none (see the README)
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


def _lm_run(model: nn.Module, out: Path, batch: int, *, use_cpu: bool = True) -> dict[str, Any]:
    """Trainer on a causal LM with padded labels: train, evaluate, predict, all at defaults
    (on the CPU, or on cuda:0 where ``use_cpu`` is false)."""
    args = lm_arguments(out, batch, use_cpu=use_cpu)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_LMRows(2 * batch), eval_dataset=_LMRows(batch + 2)
    )
    assert trainer.model_accepts_loss_kwargs
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "losses": losses,
        "metrics": trainer.evaluate(),
        "pred": trainer.predict(_LMRows(batch + 3)),
    }


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_trainer_causal_lm_is_exact_by_default(
    devices: list[str], batch: int, tmp_path: Path
) -> None:
    """Trainer passes num_items_in_batch in training and in evaluate/predict (transformers
    5.24): with the default scalars each replica gets its share of the count, so logged losses,
    eval_loss, predictions and every trained weight equal the one-device Trainer's."""
    from ._models import tiny_gpt2

    ref_model = tiny_gpt2()
    model = copy.deepcopy(ref_model)
    ref = _lm_run(ref_model, tmp_path / "one", batch)
    par = _lm_run(dp.DataParallel(model, devices), tmp_path / "par", batch)
    assert len(par["losses"]) == STEPS
    assert par["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert par["metrics"]["eval_loss"] == pytest.approx(ref["metrics"]["eval_loss"], rel=1e-5)
    assert par["pred"].metrics["test_loss"] == pytest.approx(
        ref["pred"].metrics["test_loss"], rel=1e-5
    )
    want, got = ref["pred"].predictions, par["pred"].predictions
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    assert got.shape == want.shape and got.shape[0] == batch + 3
    compare(torch.from_numpy(want), torch.from_numpy(got), "predictions")
    _weights_equal(ref_model, model, f"Trainer gpt2 default {devices}")


@pytest.mark.cuda
def test_cuda_trainer_causal_lm_with_num_items_in_batch_on_repeated_gpu(tmp_path: Path) -> None:
    """The same Trainer run with the model on cuda:0 and the wrapper on [0, 0]: Trainer moves
    the wrapper to its device, passes num_items_in_batch, and every figure is one GPU's."""
    from ._models import tiny_gpt2

    ref_model = tiny_gpt2()
    model = copy.deepcopy(ref_model)
    # torch computes float32 matmuls in full precision by default (no TF32)
    ref = _lm_run(ref_model, tmp_path / "one", 5, use_cpu=False)
    par = _lm_run(dp.DataParallel(model, [0, 0]), tmp_path / "par", 5, use_cpu=False)
    assert next(model.parameters()).device == torch.device("cuda", 0)
    assert par["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert par["metrics"]["eval_loss"] == pytest.approx(ref["metrics"]["eval_loss"], rel=1e-4)
    _weights_equal(ref_model, model, "Trainer gpt2 on [0, 0]")
