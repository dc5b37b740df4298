"""transformers' image classification example: a ViT fine-tuned under Trainer.

Source: huggingface/transformers examples/pytorch/image-classification/run_image_classification.py

Ported: the script's ``collate_fn`` (``pixel_values`` stacked, ``labels`` a tensor),
``remove_unused_columns=False`` (as the script sets it: its rows hold the image column),
``Trainer`` training, evaluation and prediction, a ViT classifier from a tiny config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._hf import Rows, arguments, losses, transformers

CLASSES = 3


def build() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=24, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def _images(n: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "pixel_values": torch.randn(3, 8, 8, generator=gen),
            "labels": int(torch.randint(0, CLASSES, (1,), generator=gen)),
        }
        for _ in range(n)
    ]


def collate_fn(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["labels"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def run_all(model: Any, run: Any, folder: Path) -> dict[str, Any]:
    trainer = transformers.Trainer(
        model=run,
        args=arguments(folder, 5, remove_unused_columns=False),
        train_dataset=Rows(_images(10, 21)),
        eval_dataset=Rows(_images(7, 22)),
        data_collator=collate_fn,
    )
    trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(Rows(_images(6, 23)))
    return {
        "losses": losses(trainer),
        "eval_loss": metrics["eval_loss"],
        "logits": pred.predictions,
    }
