"""transformers' causal language modelling example: GPT-2 trained on blocks of text.

Source: huggingface/transformers examples/pytorch/language-modeling/run_clm.py

Ported: ``group_texts`` (the tokenized stream cut into blocks of ``block_size``, labels a copy
of the ids), ``default_data_collator``, ``Trainer`` with training and evaluation (the script
reports ``eval_loss`` and its perplexity), a GPT-2 from a tiny config. The model is handed to
Trainer through the wrapper.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._hf import VOCAB, Rows, arguments, losses, transformers

BLOCK = 8


def build() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def group_texts(ids: list[int]) -> list[dict[str, Any]]:
    total = (len(ids) // BLOCK) * BLOCK
    blocks = [ids[i : i + BLOCK] for i in range(0, total, BLOCK)]
    return [{"input_ids": b, "attention_mask": [1] * BLOCK, "labels": list(b)} for b in blocks]


def run_all(model: Any, run: Any, folder: Path) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(12)
    stream = torch.randint(3, VOCAB, (BLOCK * 14 + 3,), generator=gen).tolist()
    blocks = group_texts(stream)
    trainer = transformers.Trainer(
        model=run,
        args=arguments(folder, 5),
        train_dataset=Rows(blocks[:10]),
        eval_dataset=Rows(blocks[10:]),
        data_collator=transformers.default_data_collator,
    )
    trainer.train()
    metrics = trainer.evaluate()
    return {
        "losses": losses(trainer),
        "eval_loss": metrics["eval_loss"],
        "perplexity": math.exp(metrics["eval_loss"]),
    }
