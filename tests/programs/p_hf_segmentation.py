"""transformers' semantic segmentation example: a SegFormer fine-tuned under Trainer.

Source: huggingface/transformers examples/pytorch/semantic-segmentation/run_semantic_segmentation.py

Ported: the script's ``collate_fn`` (``pixel_values`` stacked, ``labels`` the masks), its
``remove_unused_columns=False``, ``Trainer`` training, evaluation and prediction, a
``SegformerForSemanticSegmentation`` from a tiny config. The masks hold 255, the model's
``semantic_loss_ignore_index`` (void pixels, unevenly spread): its cross-entropy ignores them.
Before issue 59 the wrapper weighed each chunk's loss by its labels other than -100. The
decode head's BatchNorm is converted as the guide says (``convert_sync_batchnorm``), on one
device too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import dataparallel as dp

from ._hf import Rows, arguments, losses, transformers

CLASSES = 3


def build() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_channels=3, num_encoder_blocks=1, depths=[1], sr_ratios=[1], hidden_sizes=[8],
        patch_sizes=[3], strides=[2], num_attention_heads=[1], mlp_ratios=[2],
        decoder_hidden_size=8, num_labels=CLASSES, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0,
        semantic_loss_ignore_index=255,
    )  # fmt: skip
    return transformers.SegformerForSemanticSegmentation(config)


def plain(model: nn.Module) -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def wrap(model: nn.Module, devices: list[str]) -> nn.Module:
    return dp.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model), devices)


def _images(n: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        mask = torch.randint(0, CLASSES, (8, 8), generator=gen)
        mask[: (5 * i) % 8] = 255  # void rows, more in some images than others
        rows.append({"pixel_values": torch.randn(3, 8, 8, generator=gen), "labels": mask})
    return rows


def collate_fn(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.stack([example["labels"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def run_all(model: Any, run: Any, folder: Path) -> dict[str, Any]:
    trainer = transformers.Trainer(
        model=run,
        args=arguments(folder, 5, remove_unused_columns=False),
        train_dataset=Rows(_images(10, 31)),
        eval_dataset=Rows(_images(7, 32)),
        data_collator=collate_fn,
    )
    trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(Rows(_images(6, 33)))
    return {
        "losses": losses(trainer),
        "eval_loss": metrics["eval_loss"],
        "logits": pred.predictions,
    }
