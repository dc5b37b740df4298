"""meijieru's CRNN: a convolutional recurrent network read by CTC, its output time-major.

Source: meijieru/crnn.pytorch models/crnn.py

Ported: ``BidirectionalLSTM`` (an ``nn.LSTM`` over ``(T, b, nIn)``, its output flattened to
``(T * b, 2h)`` for the ``Linear`` and viewed back) and ``CRNN`` (conv, ReLU and max-pool
blocks to a height of 1, ``squeeze(2).permute(2, 0, 1)`` to ``(w, b, c)``, two bidirectional
LSTMs, ``log_softmax`` over the classes), and train.py's step: ``preds_size`` the frame count
per image, ``CTCLoss`` divided by the batch size, RMSprop. The output is ``(T, B, classes)``
with ``T = 5``: on chunks of 5 both readings of its batch dimension fit, so the port names it
with ``output_rules={"output": 1}`` (the gather warns without it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

NCLASS, NH, BATCH = 6, 8, 10  # classes with the CTC blank at 0; images 1 x 8 x 20: T = 5


class BidirectionalLSTM(nn.Module):
    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(n_in, n_hidden, bidirectional=True)
        self.embedding = nn.Linear(n_hidden * 2, n_out)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        recurrent, _ = self.rnn(input)
        t, b, h = recurrent.size()
        output = self.embedding(recurrent.view(t * b, h))
        return output.view(t, b, -1)


class CRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 8, 3, 1, 1), nn.ReLU(True), nn.MaxPool2d(2, 2),
            nn.Conv2d(8, 16, 3, 1, 1), nn.ReLU(True), nn.MaxPool2d(2, 2),
            nn.Conv2d(16, 16, (2, 1), 1, 0), nn.ReLU(True),
        )  # fmt: skip
        self.rnn = nn.Sequential(BidirectionalLSTM(16, NH, NH), BidirectionalLSTM(NH, NH, NCLASS))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        conv = self.cnn(input)
        _b, _c, h, _w = conv.size()
        assert h == 1, "the height of conv must be 1"
        conv = conv.squeeze(2).permute(2, 0, 1)  # [w, b, c]
        return F.log_softmax(self.rnn(conv), dim=2)


def build() -> nn.Module:
    torch.manual_seed(0)
    return CRNN()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(model, devices, output_rules={"output": 1})


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.RMSprop(model.parameters(), lr=0.01)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(3):
        image = torch.randn(BATCH, 1, 8, 20, generator=gen)
        length = torch.randint(1, 4, (BATCH,), generator=gen)
        text = torch.randint(1, NCLASS, (int(length.sum()),), generator=gen)
        out.append((image, text, length))
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (optimizer,) = opts
    image, text, length = batch
    criterion = nn.CTCLoss(zero_infinity=True)
    preds = run(image)
    preds_size = torch.full((image.size(0),), preds.size(0), dtype=torch.long)
    cost = criterion(preds, text, preds_size, length) / image.size(0)
    model.zero_grad()
    cost.backward()
    optimizer.step()
    return {"cost": cost.detach(), "preds": preds.detach()}
