"""MoCo v2: a momentum key encoder updated inside forward, contrastive logits against a queue.

Source: facebookresearch/moco moco/builder.py

Ported: the query and key encoders (small MLPs here), the momentum update of the key encoder
inside forward (``param_k.data = param_k.data * m + param_q.data * (1 - m)``), the logits of
each query against its key and the queue, and the cross-entropy with label 0. Left out: the
shuffled BatchNorm and ``concat_all_gather`` (DDP only); the enqueue, which the script does in
forward from the gathered keys of every process, is done after the call from the gathered
keys (a buffer written in forward keeps replica 0's chunk, the guide's rule).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

DIM, QUEUE, MOMENTUM, TEMPERATURE = 8, 16, 0.9, 0.2


class MoCo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, DIM))
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for param in self.encoder_k.parameters():
            param.requires_grad = False  # updated by momentum, not by the optimizer
        self.register_buffer("queue", F.normalize(torch.randn(DIM, QUEUE), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def momentum_update(self) -> None:
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True):
            pk.data = pk.data * MOMENTUM + pq.data * (1.0 - MOMENTUM)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        ptr = int(self.queue_ptr)
        self.queue[:, ptr : ptr + keys.shape[0]] = keys.T
        self.queue_ptr[0] = (ptr + keys.shape[0]) % QUEUE

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self.momentum_update()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", q, self.queue.clone().detach())
        logits = torch.cat([l_pos, l_neg], dim=1) / TEMPERATURE
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return logits, labels, k


def build() -> nn.Module:
    torch.manual_seed(0)
    return MoCo()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 12, generator=gen), torch.randn(8, 12, generator=gen)) for _ in range(3)
    ]


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    logits, labels, keys = run(*batch)
    loss = F.cross_entropy(logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.enqueue(keys)
    return {"loss": loss.detach(), "logits": logits.detach(), "keys": keys}
