"""PyTorch's translation tutorial: a GRU encoder and an attention decoder, batched.

Source: pytorch/tutorials intermediate_source/seq2seq_translation_tutorial.py

Ported: ``EncoderRNN`` (embedding, batch-first GRU), ``BahdanauAttention`` (additive scores
over the encoder outputs, softmax, the context), ``AttnDecoderRNN`` (teacher forcing: each step
feeds the target's previous token, ``log_softmax`` over the vocabulary), the two wrapped and
called as the tutorial's ``train_epoch`` calls them (the encoder's outputs and hidden state
passed to the decoder), and ``NLLLoss`` over every target token. Dropout off. One change, the
usual port to ``DataParallel``: encoder and decoder run in one wrapped forward
(``Translator``), so the encoder's hidden state, ``(1, batch, hidden)``, never crosses the
wrapper (passed between two wrappers, its batch on dim 1 would meet the default ``dim=0``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, HIDDEN, LENGTH, SOS = 15, 8, 5, 0


class EncoderRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.gru = nn.GRU(HIDDEN, HIDDEN, batch_first=True)

    def forward(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(self.embedding(source))


class BahdanauAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.Wa = nn.Linear(HIDDEN, HIDDEN)
        self.Ua = nn.Linear(HIDDEN, HIDDEN)
        self.Va = nn.Linear(HIDDEN, 1)

    def forward(self, query: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys))).squeeze(2).unsqueeze(1)
        weights = F.softmax(scores, dim=-1)
        return torch.bmm(weights, keys), weights


class AttnDecoderRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.attention = BahdanauAttention()
        self.gru = nn.GRU(2 * HIDDEN, HIDDEN, batch_first=True)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(
        self, encoder_outputs: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        batch = encoder_outputs.size(0)
        decoder_input = torch.full((batch, 1), SOS, dtype=torch.long)
        outputs = []
        for i in range(LENGTH):
            embedded = self.embedding(decoder_input)
            context, _ = self.attention(hidden.permute(1, 0, 2), encoder_outputs)
            output, hidden = self.gru(torch.cat((embedded, context), dim=2), hidden)
            outputs.append(self.out(output))
            decoder_input = target[:, i].unsqueeze(1)  # teacher forcing
        return F.log_softmax(torch.cat(outputs, dim=1), dim=-1)


class Translator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = EncoderRNN()
        self.decoder = AttnDecoderRNN()

    def forward(
        self, source: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        encoder_outputs, encoder_hidden = self.encoder(source)
        return self.decoder(encoder_outputs, encoder_hidden, target), encoder_hidden


def build() -> nn.Module:
    torch.manual_seed(0)
    return Translator()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(38)
    return [
        (
            torch.randint(1, VOCAB, (7, 6), generator=gen),
            torch.randint(1, VOCAB, (7, LENGTH), generator=gen),
        )
        for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    source, target = batch
    decoder_outputs, encoder_hidden = run(source, target)
    loss = F.nll_loss(decoder_outputs.view(-1, VOCAB), target.view(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "hidden": encoder_hidden.detach()}
