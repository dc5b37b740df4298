"""HuggingFace transformers models through DataParallel, against the model on one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dataparallel as dp

from ._models import text_batch, tiny_bert, tiny_gpt2
from ._oracle import LAYOUTS, check, compare, record

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def _loss(out: Any) -> torch.Tensor:
    return out.loss


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_bert_sequence_classification(devices: list[str], batch: int) -> None:
    data = text_batch(batch)
    data["labels"] = torch.arange(batch) % 3
    model = tiny_bert()
    _, par = check("bert", model, (), data, _loss, devices)
    out = dp.DataParallel(par, devices)(**data)
    assert type(out).__name__ == "SequenceClassifierOutput"
    assert out.loss.dim() == 0 and out.logits.shape == (batch, 3)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_bert_hidden_states_functional(devices: list[str], batch: int) -> None:
    """output_hidden_states=True, through dp.data_parallel: a tuple of (batch, seq, hidden)."""
    data = text_batch(batch, seed=1)
    data["labels"] = torch.arange(batch) % 3
    data["output_hidden_states"] = True  # type: ignore[assignment]

    def functional(module: torch.nn.Module, devs: list[str]) -> Any:
        return lambda **kw: dp.data_parallel(module, (), devs, module_kwargs=kw)

    _, par = check("bert hidden_states", tiny_bert(), (), data, _loss, devices, wrap=functional)
    out = dp.data_parallel(par, (), devices, module_kwargs=data)
    assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (batch, 9, 16)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_gpt2_lm_head_sample_mean(devices: list[str], batch: int) -> None:
    """Without labels' padding the token mean is a sample mean: exact with the defaults."""
    data = text_batch(batch, seed=2)
    data["labels"] = data["input_ids"].clone()
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    data["use_cache"] = False  # type: ignore[assignment]
    check("gpt2", tiny_gpt2(), (), data, _loss, devices)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_gpt2_use_cache(devices: list[str], batch: int) -> None:
    """use_cache=True: logits and loss as on one device; past_key_values is not a tensor or a
    container, so it comes back as one cache per replica, each holding its chunk's keys and
    values (rule 6), which together are the one-device cache, in batch order."""
    data = text_batch(batch, seed=3)
    data["labels"] = data["input_ids"].clone()
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    model = tiny_gpt2().eval()
    ref = model(**data, use_cache=True)
    out = dp.DataParallel(model, devices)(**data, use_cache=True)
    assert type(out) is type(ref)
    diff = compare(ref.logits, out.logits) + compare(ref.loss, out.loss)
    caches = out.past_key_values
    assert isinstance(caches, list) and len(caches) == len(devices)
    assert type(caches[0]) is type(ref.past_key_values)
    for layer in range(2):
        for field in ("keys", "values"):
            whole = getattr(ref.past_key_values.layers[layer], field)
            parts = torch.cat([getattr(c.layers[layer], field) for c in caches])
            diff = max(diff, compare(whole, parts, f"past_key_values[{layer}].{field}"))
    record("gpt2 use_cache", diff)
