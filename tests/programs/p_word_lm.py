"""PyTorch's word language model example, its Transformer variant: time-major batches, a
causal mask shared by the whole batch.

Source: pytorch/examples word_language_model/model.py

Ported: ``TransformerModel`` (the embedding scaled by ``sqrt(ninp)``, sinusoidal positional
encoding, ``nn.TransformerEncoder`` over ``(seq, batch, ninp)``, the square subsequent mask
``(seq, seq)`` built in forward, the decoder and ``log_softmax``), ``batchify`` (the stream cut
into columns, one per batch item) and ``get_batch``, and the step with ``NLLLoss`` and
gradient clipping. Wrapped with ``dim=1``: the batch is the second dimension. Dropout off.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

NTOKEN, NINP, BPTT, BATCH = 30, 8, 6, 5


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_len: int = 64) -> None:
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))  # (max_len, 1, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[: x.size(0), :]


class TransformerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(NINP)
        layer = nn.TransformerEncoderLayer(NINP, 2, 16, dropout=0.0)
        self.transformer_encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.input_emb = nn.Embedding(NTOKEN, NINP)
        self.decoder = nn.Linear(NINP, NTOKEN)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(len(src)).to(src.device)
        x = self.pos_encoder(self.input_emb(src) * math.sqrt(NINP))
        return F.log_softmax(self.decoder(self.transformer_encoder(x, mask)), dim=-1)


def build() -> nn.Module:
    torch.manual_seed(0)
    return TransformerModel()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(model, devices, dim=1)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(28)
    source = batchify(torch.randint(0, NTOKEN, (BATCH * 20,), generator=gen), BATCH)
    return [(source[i : i + BPTT], source[i + 1 : i + 1 + BPTT].reshape(-1)) for i in (0, 6, 12)]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    data, targets = batch
    output = run(data)
    loss = F.nll_loss(output.view(-1, NTOKEN), targets)
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    opt.step()
    return {"loss": loss.detach(), "output": output.detach()}
