"""transformers' models whose loss is not a mean over labels other than -100 (issue 59).

``Wav2Vec2ForCTC`` (CTC, ``mean``: over samples of loss / target length; ``sum``) and
``BertForPreTraining`` (masked-LM token mean + next-sentence sample mean), from tiny configs
with random weights, and peft's prompt tuning on GPT-2: the wrapped loss and every gradient are
one device's. Before, the labels' rule weighed each chunk by its labels other than -100: the
loss off by 0.68 of 12 (CTC mean), 61 of 124 (CTC sum), 1.8e-4 of 3.7 (pre-training, and a
gradient by 5e-3 relative), 3.9e-3 of 4.1 (prompt tuning).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

DEVICES = [["cpu", "cpu"], ["cpu", "cpu:1", "cpu:1"]]


def _same(model: nn.Module, devices: list[str], data: dict[str, Any]) -> None:
    model.eval()
    par = copy.deepcopy(model)
    want = model(**data).loss
    got = dp.DataParallel(par, devices)(**data).loss
    assert_close_rel(got, want, msg="loss")
    want.backward()
    got.backward()
    largest = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    for (name, p), q in zip(model.named_parameters(), par.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, name
        # a gradient zero in exact arithmetic is rounding noise: relative to the largest too
        scale = max(float(p.grad.abs().max()), 1e-3 * largest)
        diff = float((q.grad - p.grad).abs().max()) / scale
        assert diff <= 1e-4, f"{name}.grad differs by {diff} (relative)"


def tiny_wav2vec2(reduction: str) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(8)
    config = Wav2Vec2Config(
        vocab_size=7,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        conv_dim=(8, 8),
        conv_kernel=(4, 4),
        conv_stride=(2, 2),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        ctc_loss_reduction=reduction,
        ctc_zero_infinity=True,
        pad_token_id=0,
    )
    return Wav2Vec2ForCTC(config)


@pytest.mark.parametrize("devices", DEVICES, ids=len)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_wav2vec2_ctc(reduction: str, devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(9)
    audio = torch.randn(5, 80, generator=gen)
    labels = torch.randint(1, 7, (5, 6), generator=gen)
    for i, length in enumerate((1, 6, 2, 5, 3)):
        labels[i, length:] = -100  # padded as the CTC collators pad: -100
    _same(tiny_wav2vec2(reduction), devices, {"input_values": audio, "labels": labels})


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_bert_pre_training(devices: list[str]) -> None:
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(10)
    config = BertConfig(
        vocab_size=20,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(2, 20, (5, 8), generator=gen)
    labels = torch.randint(2, 20, (5, 8), generator=gen)
    labels[torch.rand(5, 8, generator=gen) < 0.7] = -100
    labels[:2] = -100  # a first chunk with no masked token: its next-sentence term still counts
    nsp = torch.randint(0, 2, (5,), generator=gen)
    data = {"input_ids": ids, "labels": labels, "next_sentence_label": nsp}
    _same(BertForPreTraining(config), devices, data)


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_peft_prompt_tuning_in_a_plain_loop(devices: list[str]) -> None:
    """peft joins -100 labels for its virtual tokens to the labels: the causal LM's shift then
    keeps each row's first label (before: the class-name guess dropped it from the count)."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from ._models import text_batch, tiny_gpt2

    torch.manual_seed(12)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    model = peft.get_peft_model(tiny_gpt2(), config)
    data = text_batch(5, seed=13)
    data["labels"][:2, 2:] = -100  # few labelled tokens in the first chunk
    _same(model, devices, data)


def test_an_moe_router_loss_is_told_once() -> None:
    """Qwen2-MoE with its router loss: a load-balancing term computed from router logits alone
    (no loss function builds it) that differs between chunks: told once per place, naming the
    output and scalar_weights=; the cross-entropy term beside it is still re-formed."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(14)
    config = Qwen2MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        max_position_embeddings=32,
    )
    model = Qwen2MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(15)
    ids = torch.randint(0, 32, (5, 8), generator=gen)
    labels = ids.masked_fill(torch.rand(5, 8, generator=gen) < 0.3, -100)
    wrapped = dp.DataParallel(copy.deepcopy(model), ["cpu", "cpu"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = wrapped(input_ids=ids, labels=labels).loss
    told = [str(w.message) for w in caught if "cannot be re-formed" in str(w.message)]
    assert len(told) == 1, told
    assert told[0].startswith("output['loss']: ") and "differs between chunks" in told[0]
    assert "scalar_weights=" in told[0]
    want = model(input_ids=ids, labels=labels).loss
    assert_close_rel(got, want, rtol=1e-2)  # close, not exact: the router term is a guess
