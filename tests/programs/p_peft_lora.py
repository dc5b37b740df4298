"""peft's LoRA for causal language modelling: train the adapter, evaluate, save it, resume
from a checkpoint, load it back.

Source: huggingface/peft examples/causal_language_modeling/train.py

Ported: ``LoraConfig`` on the attention projections, ``get_peft_model``, training under
``Trainer`` at its defaults (``remove_unused_columns=True``: the wrapper presents the base
model's signature, so the columns stay), then Trainer's own ``trainer.save_model`` (the
wrapper's state dict of a peft model is the peft model's own, which peft's save reads), and
``PeftModel.from_pretrained`` on a fresh base model, whose outputs are the trained model's;
then ``train(resume_from_checkpoint=...)`` from the step-2 checkpoint, two steps further. No
``label_names``: Trainer reads them from the peft model's base model, and the wrapper of a peft
model is an instance of its peft class, so ``evaluate`` reports the loss and the resume loads
the adapter as without the wrapper.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ._hf import VOCAB, Rows, arguments, losses, transformers

peft = pytest.importorskip("peft", reason="peft is not installed")


def _base() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def build() -> nn.Module:
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights=False, task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(1)
    return peft.get_peft_model(_base(), config)


def _rows(n: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (8,), generator=gen)
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": ids.clone(),
                "id": 0,
            }
        )
    return rows


def run_all(model: Any, run: Any, folder: Path) -> dict[str, Any]:
    def trainer(**overrides: Any) -> Any:
        args = arguments(
            folder, 5, label_names=None, save_strategy="steps", save_steps=2, **overrides
        )
        return transformers.Trainer(
            model=run, args=args, train_dataset=Rows(_rows(10, 24)), eval_dataset=Rows(_rows(4, 26))
        )

    first = trainer()
    first.train()
    evaluated = first.evaluate()["eval_loss"]
    first.save_model(str(folder / "adapter"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the base model's config warnings)
        again = peft.PeftModel.from_pretrained(_base(), str(folder / "adapter"))
    probe = {
        k: torch.stack([row[k] for row in _rows(3, 25)]) for k in ("input_ids", "attention_mask")
    }
    reloaded = again(**probe).logits
    assert torch.equal(reloaded, copy.deepcopy(model)(**probe).logits)  # exactly the trained one
    resumed = trainer(max_steps=4)
    resumed.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
    return {
        "losses": losses(first),
        "eval_loss": torch.tensor(evaluated),
        "resumed": losses(resumed),
        "reloaded": reloaded.detach(),
    }
