"""deepspeech.pytorch: a convolutional front end and bidirectional RNNs over packed,
variable-length utterances, trained with CTC.

Source: SeanNaren/deepspeech.pytorch deepspeech_pytorch/model.py

Ported: the convolution over the spectrogram, the output lengths computed from the input
lengths through it, ``BatchRNN`` (pack with the lengths, a bidirectional GRU, unpack, sum of
the two directions), the linear head and ``log_softmax``, and the step's ``CTCLoss`` over the
time-major output. One change the guide asks for: ``pad_packed_sequence(...,
total_length=...)``, so every chunk's output has the batch's length (without it the
replicas' outputs differ in length, and the wrapper's error names ``total_length``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

FEATURES, HIDDEN, LABELS = 6, 8, 5


class BatchRNN(nn.Module):
    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.rnn = nn.GRU(inputs, HIDDEN, bidirectional=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        total = x.shape[0]
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, total_length=total)
        return out.view(out.size(0), out.size(1), 2, -1).sum(2)


class DeepSpeech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 4, (3, 3), stride=(1, 2), padding=(1, 1)), nn.Hardtanh(0, 20)
        )
        self.rnns = nn.ModuleList([BatchRNN(4 * 2 * FEATURES), BatchRNN(HIDDEN)])
        self.fc = nn.Linear(HIDDEN, LABELS, bias=False)

    def get_seq_lens(self, lengths: torch.Tensor) -> torch.Tensor:
        conv = self.conv[0]
        return (
            lengths + 2 * conv.padding[1] - conv.dilation[1] * (conv.kernel_size[1] - 1) - 1
        ) // conv.stride[1] + 1

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output_lengths = self.get_seq_lens(lengths)
        x = self.conv(x)  # (batch, channels, features, time)
        b, c, f, t = x.shape
        x = x.view(b, c * f, t).permute(2, 0, 1)  # (time, batch, features)
        for rnn in self.rnns:
            x = rnn(x, output_lengths)
        return F.log_softmax(self.fc(x), dim=-1), output_lengths


def build() -> nn.Module:
    torch.manual_seed(0)
    return DeepSpeech()


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(8)
    out = []
    for _ in range(3):
        lengths = torch.tensor([16, 13, 16, 9, 11])
        spect = torch.randn(5, 1, FEATURES * 2, 16, generator=gen)
        targets = torch.randint(1, LABELS, (5, 3), generator=gen)
        out.append((spect, lengths, targets))
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (opt,) = opts
    spect, lengths, targets = batch
    out, output_lengths = run(spect, lengths)  # out: (time, batch, labels)
    loss = (
        nn.CTCLoss(reduction="sum", zero_infinity=True)(
            out, targets, output_lengths, torch.full((5,), 3, dtype=torch.long)
        )
        / spect.shape[0]
    )
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.detach(), "out": out.detach(), "lengths": output_lengths}
