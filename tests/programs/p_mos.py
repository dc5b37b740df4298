"""Mixture of Softmaxes language model: per-layer LSTM states passed as a list, time-major.

Source: zihangdai/mos model.py

Ported: the embedding, one LSTM per layer, each fed and returning its own ``(h, c)`` from a
list of per-layer states, the mixture of softmaxes over the last layer's output (a prior over
``n_experts`` softmaxes, mixed in probability space), and the script's step: the wrapper with
``dim=1`` (``nn.DataParallel(model, dim=1)``: the batch is on dim 1), the hidden state carried
and detached between steps, the NLL of the log mixture, gradient clipping. Left out: dropouts
(they are off in the comparison) and weight tying.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

NTOKEN, NINP, NHID, NLAYERS, NEXPERTS = 20, 8, 8, 2, 3


class RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(NTOKEN, NINP)
        self.rnns = nn.ModuleList(nn.LSTM(NINP if i == 0 else NHID, NHID) for i in range(NLAYERS))
        self.prior = nn.Linear(NHID, NEXPERTS, bias=False)
        self.latent = nn.Sequential(nn.Linear(NHID, NEXPERTS * NINP), nn.Tanh())
        self.decoder = nn.Linear(NINP, NTOKEN)

    def forward(self, tokens: torch.Tensor, hidden: list[Any]) -> tuple[torch.Tensor, list[Any]]:
        output = self.encoder(tokens)
        new_hidden = []
        for rnn, state in zip(self.rnns, hidden, strict=True):
            output, state = rnn(output, state)
            new_hidden.append(state)
        logit = self.decoder(self.latent(output).view(-1, NINP))
        prior = F.softmax(self.prior(output).view(-1, NEXPERTS), dim=-1)
        prob = F.softmax(logit.view(-1, NTOKEN), dim=-1).view(-1, NEXPERTS, NTOKEN)
        mixed = (prob * prior.unsqueeze(2)).sum(1)
        log_prob = torch.log(mixed.add_(1e-8)).view(tokens.shape[0], tokens.shape[1], NTOKEN)
        return log_prob, new_hidden

    def init_hidden(self, bsz: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(1, bsz, NHID), torch.zeros(1, bsz, NHID)) for _ in range(NLAYERS)]


def build() -> nn.Module:
    torch.manual_seed(0)
    return RNNModel()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(model, devices, dim=1)


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(2)
    stream = torch.randint(0, NTOKEN, (4 * 6 + 1, 5), generator=gen)  # (time, batch)
    return [(stream[i : i + 6], stream[i + 1 : i + 7]) for i in range(0, 18, 6)]


def _detach(hidden: list[Any]) -> list[Any]:
    return [tuple(t.detach() for t in state) for state in hidden]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    tokens, targets = batch
    hidden = memo.get("hidden") or model.init_hidden(tokens.shape[1])
    log_prob, hidden = run(tokens, hidden)
    memo["hidden"] = _detach(hidden)
    loss = F.nll_loss(log_prob.view(-1, NTOKEN), targets.reshape(-1))
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    opt.step()
    h_last = hidden[-1][0].detach()
    return {"loss": loss.detach(), "log_prob": log_prob.detach(), "h_last": h_last}
