"""What the ported transformers scripts share: their Trainer arguments (short SGD runs on the
CPU, one log line per step, nothing saved), tiny configs, and rows as ``datasets`` gives them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

VOCAB = 40


def arguments(folder: Path, batch: int, seq2seq: bool = False, **overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(folder),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        max_steps=3,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        # Trainer reads label names from the model's class, and a wrapper's names none: the
        # one line a port adds (the guide's "label_names"), or evaluate() reports no loss
        label_names=["labels"],
    )
    cls = transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments
    return cls(**{**settings, **overrides})


class Rows(torch.utils.data.Dataset[dict[str, Any]]):
    """A dataset's rows: one dict per sample, as ``datasets`` gives a Trainer."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def tokenizer() -> Any:
    """A word-level tokenizer built here (nothing downloaded), for the collators that pad and
    mask: ``[PAD]`` 0, ``[MASK]`` 1, ``</s>`` 2, words ``t3`` to ``t39``."""
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, "[MASK]": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")),
        pad_token="[PAD]",
        mask_token="[MASK]",
        eos_token="</s>",
    )


def bert_config(**extra: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )
