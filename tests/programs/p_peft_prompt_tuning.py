"""peft's prompt tuning of a causal LM in a plain loop: virtual tokens before the text, the
prompt's labels -100 and the target's labels the tokens.

Source: huggingface/peft examples/causal_language_modeling/prompttuning_pert.py

Ported: the script's ``PromptTuningConfig`` (``CAUSAL_LM``, random init) and
``get_peft_model`` on a causal LM (a tiny GPT-2 with random weights in place of bloomz-560m),
its ``preprocess_function`` (each sample's text labelled -100, its target's tokens labelled, left
padding with the pad id and -100), and its loop: ``outputs = model(**batch)``,
``outputs.loss.backward()``, ``optimizer.step()``, with AdamW over the prompt's embedding. peft
joins -100 labels for the virtual tokens to the labels, so the loss is observed where GPT-2
computes it (issue 59). As in the script, every row starts with its text (labelled -100): the
labels' rule before issue 59 counted these right too (this program passes on that code); the
row whose first token is labelled, which it miscounted, is
``tests/integration/test_loss_terms_models.py::test_peft_prompt_tuning_in_a_plain_loop``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft", reason="peft is not installed")

VOCAB, SEQ = 30, 10


def build() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    prompt = peft.PromptTuningConfig(
        task_type="CAUSAL_LM", prompt_tuning_init="RANDOM", num_virtual_tokens=4
    )
    return peft.get_peft_model(GPT2LMHeadModel(config), prompt)


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [torch.optim.AdamW(trainable, lr=3e-2)]


def batches() -> list[Any]:
    """The script's preprocessing: text then target, the text labelled -100, left padding."""
    gen = torch.Generator().manual_seed(43)
    out = []
    for _ in range(3):
        ids = torch.zeros(7, SEQ, dtype=torch.long)  # pad id 0
        labels = torch.full((7, SEQ), -100)
        mask = torch.zeros(7, SEQ, dtype=torch.long)
        for i in range(7):
            text = int(torch.randint(2, 6, (1,), generator=gen))
            target = int(torch.randint(1, 4, (1,), generator=gen))
            tokens = torch.randint(1, VOCAB, (text + target,), generator=gen)
            start = SEQ - text - target
            ids[i, start:] = tokens
            mask[i, start:] = 1
            labels[i, start + text :] = tokens[text:]
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    outputs = run(**batch)
    loss = outputs.loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return {"loss": loss.detach(), "logits": outputs.logits.detach()}
