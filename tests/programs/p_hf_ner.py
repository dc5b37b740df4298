"""transformers' token classification example (NER): word labels on the first sub-token,
-100 on the others and on the padding.

Source: huggingface/transformers examples/pytorch/token-classification/run_ner.py

Ported: ``tokenize_and_align_labels`` (a word's label on its first sub-token, -100 on the
rest, as ``label_all_tokens=False``), ``DataCollatorForTokenClassification`` (pads the labels
with -100), ``Trainer`` training, evaluation and prediction (the script takes the argmax of
the predictions where the label is not -100), a BERT token classifier from a tiny config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ._hf import VOCAB, Rows, arguments, bert_config, losses, tokenizer, transformers

LABELS = 5


def build() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForTokenClassification(bert_config(num_labels=LABELS))


def _sentences(n: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids: list[int] = []
        labels: list[int] = []
        for _word in range(int(torch.randint(2, 6, (1,), generator=gen))):
            pieces = int(torch.randint(1, 3, (1,), generator=gen))
            label = int(torch.randint(0, LABELS, (1,), generator=gen))
            ids += torch.randint(3, VOCAB, (pieces,), generator=gen).tolist()
            labels += [label] + [-100] * (pieces - 1)
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return rows


def run_all(model: Any, run: Any, folder: Path) -> dict[str, Any]:
    trainer = transformers.Trainer(
        model=run,
        args=arguments(folder, 5),
        train_dataset=Rows(_sentences(10, 15)),
        eval_dataset=Rows(_sentences(7, 16)),
        data_collator=transformers.DataCollatorForTokenClassification(tokenizer()),
    )
    trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(Rows(_sentences(6, 17)))
    kept = pred.label_ids != -100
    return {
        "losses": losses(trainer),
        "eval_loss": metrics["eval_loss"],
        "test_loss": pred.metrics["test_loss"],
        "tags": np.argmax(pred.predictions, axis=2)[kept],
    }
