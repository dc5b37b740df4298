"""BERT pre-training: the masked-LM token mean plus the next-sentence sample mean, in forward.

Source: NVIDIA/DeepLearningExamples PyTorch/LanguageModeling/BERT/run_pretraining.py

Ported: ``BertForPreTraining`` (transformers' model of the same heads) from a tiny config with
random weights, masked tokens labelled and the rest -100, a next-sentence label per pair; the
model's summed loss, backward, step. A chunk may hold no masked token: its next-sentence term
still counts (before issue 59 the wrapper weighed both terms by the masked tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def build() -> nn.Module:
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
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
    return BertForPreTraining(config)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(42)
    out = []
    for _ in range(3):
        ids = torch.randint(2, 20, (7, 8), generator=gen)
        labels = ids.masked_fill(torch.rand(7, 8, generator=gen) > 0.25, -100)
        labels[:3] = -100  # the first chunk masks nothing
        nsp = torch.randint(0, 2, (7,), generator=gen)
        out.append({"input_ids": ids, "labels": labels, "next_sentence_label": nsp})
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    out = run(**batch)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    return {"loss": out.loss.detach()}
