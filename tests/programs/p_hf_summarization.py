"""transformers' summarization example: T5 under Seq2SeqTrainer, predicting with generate.

Source: huggingface/transformers examples/pytorch/summarization/run_summarization.py

Ported: ``DataCollatorForSeq2Seq`` (labels padded with -100), ``Seq2SeqTrainer`` with
``predict_with_generate=True`` and ``generation_max_length``, training, evaluation and
prediction (the generated ids the script decodes), a T5 from a tiny config. T5's loss is a mean
over its own label tokens and ignores ``num_items_in_batch``: the labels' rule weighs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._hf import VOCAB, Rows, arguments, losses, tokenizer, transformers


def build() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_ff=24, d_kv=8, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _pairs(n: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        source = torch.randint(
            3, VOCAB, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen
        )
        target = torch.randint(
            3, VOCAB, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen
        )
        rows.append(
            {
                "input_ids": [*source.tolist(), 2],
                "attention_mask": [1] * (len(source) + 1),
                "labels": [*target.tolist(), 2],
            }
        )
    return rows


def run_all(model: Any, run: Any, folder: Path) -> dict[str, Any]:
    args = arguments(folder, 5, seq2seq=True, predict_with_generate=True, generation_max_length=6)
    trainer = transformers.Seq2SeqTrainer(
        model=run,
        args=args,
        train_dataset=Rows(_pairs(10, 18)),
        eval_dataset=Rows(_pairs(7, 19)),
        data_collator=transformers.DataCollatorForSeq2Seq(
            tokenizer(), model=model, label_pad_token_id=-100
        ),
    )
    trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(Rows(_pairs(6, 20)))
    return {
        "losses": losses(trainer),
        "eval_loss": metrics["eval_loss"],
        "generated": pred.predictions,
    }
