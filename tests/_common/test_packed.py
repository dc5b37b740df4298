"""``dataparallel._common.packed``: a ``PackedSequence`` is split by sequence, re-packed on each
device and gathered back, so the result is the one-device result (the oracle), gradients too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

import dataparallel as dp
from dataparallel._common.packed import gather_packed, is_packed, sequence_count, take_packed

LENGTHS = [3, 7, 1, 5, 4]  # unsorted: chunks get sequences of different lengths


def _packed(features: int = 2, requires_grad: bool = False) -> PackedSequence:
    torch.manual_seed(0)
    seqs = [torch.randn(n, features, requires_grad=requires_grad) for n in LENGTHS]
    return pack_sequence(seqs, enforce_sorted=False)


def _unpacked(packed: PackedSequence) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_packed_sequence(packed, batch_first=True)


def test_is_packed_and_sequence_count() -> None:
    packed = _packed()
    assert is_packed(packed)
    assert not is_packed(tuple(packed))  # the namedtuple's fields are not a PackedSequence
    assert sequence_count(packed) == len(LENGTHS)


@pytest.mark.parametrize("cuts", [[2, 3], [1, 1, 3], [5]])
def test_take_then_gather_gives_the_input_back(cuts: list[int]) -> None:
    packed = _packed()
    padded, lengths = _unpacked(packed)
    chunks, start = [], 0
    for size in cuts:
        chunk = take_packed(padded, lengths, start, size, lambda t: t)
        chunk_padded, chunk_lengths = _unpacked(chunk)
        assert chunk_lengths.tolist() == LENGTHS[start : start + size]
        assert chunk_padded.shape[1] == max(LENGTHS[start : start + size])  # no dead padding
        chunks.append(chunk)
        start += size
    again_padded, again_lengths = _unpacked(gather_packed(chunks, torch.device("cpu")))
    assert again_lengths.tolist() == LENGTHS
    torch.testing.assert_close(again_padded, padded)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(2, 3)

    def forward(self, seqs: PackedSequence) -> PackedSequence:
        out, _ = self.gru(seqs)
        return out


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu", "cpu"]])
def test_data_parallel_on_packed_input_matches_one_device(devices: list[str]) -> None:
    torch.manual_seed(1)
    module = Recurrent()
    packed = _packed(requires_grad=True)
    expected = module(packed)
    (grad_expected,) = torch.autograd.grad(expected.data.sum(), packed.data)

    packed = _packed(requires_grad=True)
    out = dp.DataParallel(module, devices)(packed)
    assert isinstance(out, PackedSequence)
    got_padded, got_lengths = _unpacked(out)
    want_padded, want_lengths = _unpacked(expected)
    assert got_lengths.tolist() == want_lengths.tolist() == LENGTHS
    torch.testing.assert_close(got_padded, want_padded)
    (grad_got,) = torch.autograd.grad(out.data.sum(), packed.data)
    # both inputs were built alike (same seed, same lengths): their packed data lines up
    torch.testing.assert_close(grad_got, grad_expected)


def test_each_replica_receives_whole_sequences() -> None:
    seen: list[list[int]] = []

    class Lengths(nn.Module):
        def forward(self, seqs: PackedSequence) -> PackedSequence:
            seen.append(_unpacked(seqs)[1].tolist())
            return seqs

    dp.DataParallel(Lengths(), ["cpu", "cpu"])(_packed())
    assert sorted(seen) == sorted([LENGTHS[:3], LENGTHS[3:]])
