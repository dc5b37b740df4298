"""CTC speech fine-tuning: Wav2Vec2ForCTC on padded transcripts, its loss computed in forward.

Source: huggingface/transformers examples/pytorch/speech-recognition/run_speech_recognition_ctc.py

Ported: the script's model (``Wav2Vec2ForCTC`` with ``ctc_loss_reduction="mean"``, the
script's default, and ``ctc_zero_infinity``), from a tiny config with random weights; the
collator's labels padded with -100; the loss the model returns, backward, step. The mean is
over samples of each loss over its transcript's length: before issue 59 the wrapper weighed
it by each chunk's labels other than -100.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def build() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        vocab_size=7,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        conv_dim=(8, 8),
        conv_kernel=(4, 4),
        conv_stride=(2, 2),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
        pad_token_id=0,
    )
    return Wav2Vec2ForCTC(config)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(41)
    out = []
    for _ in range(3):
        audio = torch.randn(7, 80, generator=gen)
        labels = torch.randint(1, 7, (7, 6), generator=gen)
        lengths = torch.randint(1, 7, (7,), generator=gen)
        labels = labels.masked_fill(torch.arange(6)[None, :] >= lengths[:, None], -100)
        out.append({"input_values": audio, "labels": labels})
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    out = run(**batch)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    return {"loss": out.loss.detach(), "logits": out.logits.detach()}
