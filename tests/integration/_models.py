"""Tiny real models, built from configs with random weights (nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 61
SEQ = 9


def tiny_bert(num_labels: int = 3) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        num_labels=num_labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
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
        loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)


def text_batch(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, an attention mask with right padding of varied lengths, and LM labels with
    -100 on the padding: the chunks of a split hold different numbers of labelled tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, SEQ), generator=gen)
    lengths = torch.tensor([SEQ - (3 * i) % SEQ for i in range(batch)]).clamp(min=2)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_llama() -> nn.Module:
    """A Llama-style causal LM (rotary positions, RMSNorm, grouped-query attention): its loss
    shifts the labels, and Trainer counts ``num_items_in_batch`` from its ``loss_type``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)
