"""transformers' masked language modelling example: BERT with the MLM collator.

Source: huggingface/transformers examples/pytorch/language-modeling/run_mlm.py

Ported: ``DataCollatorForLanguageModeling`` (30% of the tokens masked here, the script's 15%
on lines this short could leave an evaluation batch with none; labels -100 elsewhere,
so each chunk holds its own number of label tokens), lines padded to the longest of a batch,
``Trainer`` training and evaluation, a BERT masked LM from a tiny config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._hf import VOCAB, Rows, arguments, bert_config, losses, tokenizer, transformers


def build() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(bert_config())


def _lines(n: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 12, (1,), generator=gen))
        ids = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length})
    return rows


def run_all(model: Any, run: Any, folder: Path) -> dict[str, Any]:
    collator = transformers.DataCollatorForLanguageModeling(
        tokenizer(), mlm_probability=0.15, seed=3
    )
    trainer = transformers.Trainer(
        model=run,
        args=arguments(folder, 5),
        train_dataset=Rows(_lines(10, 13)),
        eval_dataset=Rows(_lines(7, 14)),
        data_collator=collator,
    )
    trainer.train()
    return {"losses": losses(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
