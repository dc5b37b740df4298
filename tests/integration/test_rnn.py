"""nn.LSTM on a PackedSequence (split by sequence) and on padded input with lengths."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import (
    PackedSequence,
    pack_padded_sequence,
    pad_packed_sequence,
)

import dataparallel as dp
from _close import assert_close_rel

from ._oracle import LAYOUTS, check

T, F, H = 8, 3, 5


def padded_batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, T, F, generator=gen)
    lengths = torch.tensor([1 + (3 * i + 2) % T for i in range(batch)])
    return x, lengths


class PackedLSTM(nn.Module):
    """A PackedSequence in, a PackedSequence and the last hidden state (batch first) out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(F, H, num_layers=2, batch_first=True)

    def forward(self, packed: PackedSequence) -> tuple[PackedSequence, torch.Tensor]:
        out, (h, _) = self.lstm(packed)
        return out, h[-1]  # h is (layers, batch, H): batch on dim 1, so return a batch-first view


def _packed_loss(out: Any) -> torch.Tensor:
    padded, lengths = pad_packed_sequence(out[0], batch_first=True)
    return padded.pow(2).sum() / lengths.sum() + out[1].pow(2).mean()


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_lstm_on_packed_sequence(devices: list[str], batch: int) -> None:
    x, lengths = padded_batch(batch)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    check("lstm PackedSequence", PackedLSTM(), (packed,), {}, _packed_loss, devices)
    plan = dp.plan((packed,), None, devices)
    assert plan.batch_size == batch and plan.entries[0].rule == "split"
    assert "split by sequence" in plan.entries[0].why
    chunks = "/".join(str(n) for n in plan.chunk_sizes)
    assert f"PackedSequence of {chunks} sequences, float32" in str(plan)  # what explain prints


def test_packed_chunks_are_whole_sequences_and_gradients_reach_the_input() -> None:
    x, lengths = padded_batch(5)
    x.requires_grad_(True)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    chunks = dp.scatter((packed,), ["cpu", "cpu"])
    got = [pad_packed_sequence(c[0], batch_first=True) for c in chunks]
    assert [len(lens) for _, lens in got] == [3, 2]
    assert torch.equal(torch.cat([lens for _, lens in got]), lengths)
    for (padded, lens), start in zip(got, [0, 3], strict=True):
        for i, n in enumerate(lens.tolist()):
            assert torch.equal(padded[i, :n], x[start + i, :n].detach())
    sum(p.sum() for p, _ in got).backward()
    expected = (torch.arange(T)[None, :] < lengths[:, None]).float()[..., None].expand_as(x)
    assert torch.equal(x.grad, expected)


class PaddedLSTM(nn.Module):
    """torch's recipe for padded input and lengths: pack inside, unpack to total_length, so
    every chunk's output has the full time dimension and the chunks concatenate."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(F, H, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return out


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_lstm_on_padded_input_with_lengths(devices: list[str], batch: int) -> None:
    x, lengths = padded_batch(batch)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    check("lstm padded + lengths", PaddedLSTM(), (x, lengths), {}, loss, devices)


def test_packed_sequence_on_one_device_takes_the_plan() -> None:
    """One device: the plan still re-packs (lengths stay on the CPU, as torch requires)."""
    x, lengths = padded_batch(5)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    model = PackedLSTM()
    out, h = dp.DataParallel(model, ["cpu"])(packed)
    ref, ref_h = model(packed)
    assert out.batch_sizes.device.type == "cpu"
    assert torch.equal(pad_packed_sequence(out, True)[0], pad_packed_sequence(ref, True)[0])
    assert torch.equal(h, ref_h)


# -- an RNN step output that has a hidden state's shape (issue 29, item 10) ---------------------

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


class Head(nn.Module):
    """A batch-first RNN then a Linear of the RNN's width: on an even split whose chunk size is
    layers*directions and equals the number of steps, each replica's output has the shape of
    the RNN's hidden state, batch on dim 1, though its batch is on dim 0."""

    def __init__(self, kind: str, layers: int) -> None:
        super().__init__()
        torch.manual_seed(layers)
        self.rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[kind](4, 8, layers, batch_first=True)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.rnn(x)[0])


@pytest.mark.parametrize(
    ("kind", "layers", "shape", "devices"),
    [
        ("gru", 1, (2, 1, 4), ["cpu", "cpu"]),
        ("gru", 1, (2, 1, 4), ["cpu", "cpu:1"]),
        ("gru", 1, (3, 1, 4), ["cpu", "cpu:1", "cpu:1"]),
        ("lstm", 2, (4, 2, 4), ["cpu", "cpu"]),
        ("lstm", 2, (4, 2, 4), ["cpu", "cpu:1"]),
        ("lstm", 2, (6, 2, 4), ["cpu", "cpu:1", "cpu:1"]),
    ],
)
def test_a_step_output_shaped_like_a_state_is_one_devices_with_a_warning(
    kind: str, layers: int, shape: tuple[int, ...], devices: list[str]
) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    model = Head(kind, layers)
    want = model(x)
    with pytest.warns(UserWarning, match=r"^output: every replica returned shape") as caught:
        got = dp.DataParallel(model, devices)(x)
    assert got.shape == want.shape == (shape[0], shape[1], 8)
    assert_close_rel(got, want)
    message = str(caught[0].message)
    assert "output_rules={'output': 1}" in message and "output_rules={'output': 0}" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rule settles it: silent
        again = dp.DataParallel(model, devices, output_rules={"output": 0})(x)
    assert_close_rel(again, want)


class Whole(nn.Module):
    """An LSTM's own return, (output, (h_n, c_n)), with every tensor of one shape per chunk."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(4, 8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> Any:
        return self.lstm(x)


@pytest.mark.parametrize("devices", DEVICE_LISTS)
def test_an_rnns_own_return_is_read_by_position_without_a_warning(devices: list[str]) -> None:
    x = torch.randn(2 * len(devices), 2, 4, generator=torch.Generator().manual_seed(2))
    model = Whole()
    want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = dp.DataParallel(model, devices)(x)
    assert got[0].shape == want[0].shape and got[1][0].shape == want[1][0].shape
    assert want[1][0].shape == (2, x.shape[0], 8)
    for g, w in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        assert_close_rel(g, w)


class StateOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gru = nn.GRU(4, 8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[1]


def test_a_state_returned_alone_needs_the_rule_the_warning_names() -> None:
    x = torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(3))
    model = StateOnly()
    want = model(x)  # (2, 4, 8): batch on dim 1; each chunk's (2, 2, 8) fits either reading
    with pytest.warns(UserWarning, match=r"output_rules=\{'output': 1\}"):
        guessed = dp.DataParallel(model, ["cpu", "cpu"])(x)
    assert guessed.shape == (4, 2, 8)  # the tie-break: torch's reading
    got = dp.DataParallel(model, ["cpu", "cpu"], output_rules={"output": 1})(x)
    assert_close_rel(got, want)
