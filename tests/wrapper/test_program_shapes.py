"""Inputs and outputs that real scripts use (issue 49, item 5), each against one device:

- a list of per-layer hidden states with the batch on dim 1 (MoS, AWD-LSTM, DARTS-RNN): a list
  whose length is not the batch size, every tensor inside batched, is split inside;
- a loss returned as ``(1,)`` (VQ-VAE-2's ``latent_loss.unsqueeze(0)``): one value per replica;
- a matrix over the chunk's own samples (CLIP's ``a @ b.t()`` inside forward): refused on
  uneven chunks, with the port that works;
- ``pad_packed_sequence`` without ``total_length`` (deepspeech.pytorch): the error names it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


class LayeredLSTM(nn.Module):
    """An RNN language model's step: one LSTM per layer, ``hidden`` a list of ``(h, c)``
    per layer, time-major (the batch on dim 1), the new hidden returned as such a list."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnns = nn.ModuleList(nn.LSTM(4, 4) for _ in range(layers))
        self.decoder = nn.Linear(4, 7)

    def forward(self, x: torch.Tensor, hidden: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        new = []
        for rnn, state in zip(self.rnns, hidden, strict=True):
            x, state = rnn(x, state)
            new.append(state)
        return self.decoder(x), new


def _hidden(layers: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, batch, 4, generator=gen), torch.randn(1, batch, 4, generator=gen))
        for _ in range(layers)
    ]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("layers", [2, 3])
def test_per_layer_hidden_states_with_the_batch_on_dim_1(devices: list[str], layers: int) -> None:
    """Before: the list (length = the number of layers) was broadcast whole, and the LSTM
    raised 'Expected hidden[0] size (1, 2, 4), got [1, 3, 4]'."""
    ref = LayeredLSTM(layers)
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices, dim=1)
    for call, batch in enumerate((5, 5, 4)):  # the same signature again, then another batch
        x = torch.randn(6, batch, 4, generator=torch.Generator().manual_seed(call))
        hidden = _hidden(layers, batch, seed=10 + call)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing broadcast, nothing to warn about
            out, new = wrapper(x, hidden)
        want, want_new = ref(x, hidden)
        assert_close_rel(out, want)
        assert isinstance(new, list) and len(new) == layers
        for (h, c), (h_ref, c_ref) in zip(new, want_new, strict=True):
            assert h.shape == (1, batch, 4)
            assert_close_rel(h, h_ref)
            assert_close_rel(c, c_ref)
        (out.sum() + sum(h.sum() for h, _ in new)).backward()
        (want.sum() + sum(h.sum() for h, _ in want_new)).backward()
    for p, q in zip(par.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close_rel(p.grad, q.grad)


def test_explain_shows_the_hidden_states_split_inside() -> None:
    plan = dp.DataParallel(LayeredLSTM(), ["cpu", "cpu"], dim=1).explain(
        torch.randn(6, 5, 4), _hidden(2, 5, seed=1)
    )
    rules = {entry.path: entry.rule for entry in plan.entries}
    assert rules["args[1][0][0]"] == rules["args[1][1][1]"] == "split"
    assert plan.warnings == []


def test_a_list_with_tensors_of_another_size_is_still_broadcast_with_a_warning() -> None:
    """The container reading needs every tensor inside batched; else the list is what it
    was, broadcast whole, and the user is told."""
    boxes = [torch.randn(3, 4), torch.randn(2, 4)]  # two samples' boxes, for a batch of 4
    plan = dp.plan((torch.randn(4, 3), boxes), {}, ["cpu", "cpu"])
    rules = {entry.path: entry.rule for entry in plan.entries}
    assert rules["args[1]"] == "broadcast"
    assert plan.warnings and "args[1]" in plan.warnings[0]


class UnsqueezedLoss(nn.Module):
    """VQ-VAE-2's return: the decoded batch and a loss kept as shape (1,)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.net(x)
        return y, (y - x).pow(2).mean().unsqueeze(0)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("batch", [5, 6])
def test_a_loss_of_shape_1_is_one_value_per_replica(devices: list[str], batch: int) -> None:
    """Before: chunks 2/2/1 were refused with advice about squeeze(), and chunks 3/2 gave a
    vector of two losses. Now one device's (1,) value and gradients."""
    x = torch.randn(batch, 4, generator=torch.Generator().manual_seed(batch))
    ref = UnsqueezedLoss()
    par = copy.deepcopy(ref)
    y, loss = dp.DataParallel(par, devices)(x)
    y_ref, loss_ref = ref(x)
    assert loss.shape == (1,)
    assert_close_rel(loss, loss_ref)
    assert_close_rel(y, y_ref)
    loss.sum().backward()
    loss_ref.sum().backward()
    for p, q in zip(par.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close_rel(p.grad, q.grad)


def test_scalars_stack_gives_torchs_vector_of_shape_1_losses() -> None:
    x = torch.randn(5, 4)
    model = UnsqueezedLoss()
    _, losses = dp.DataParallel(model, ["cpu", "cpu", "cpu"], scalars="stack")(x)
    parts = [model(x[a:b])[1] for a, b in ((0, 2), (2, 4), (4, 5))]
    assert losses.shape == (3,)
    assert_close_rel(losses, torch.cat(parts))


class Similarity(nn.Module):
    """CLIP's forward: both towers, and the logits over the batch's pairs."""

    def __init__(self, inside: bool = True) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.image = nn.Linear(4, 8)
        self.text = nn.Linear(5, 8)
        self.inside = inside

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> Any:
        a, b = self.image(images), self.text(texts)
        return a @ b.t() if self.inside else (a, b)


def test_a_matrix_over_the_chunks_samples_is_refused_with_the_port() -> None:
    """Uneven chunks: the blocks cannot even be joined; before, torch's 'Sizes of tensors
    must match'."""
    images, texts = torch.randn(5, 4), torch.randn(5, 5)
    with pytest.raises(ValueError, match=r"square matrix over its own chunk's samples") as err:
        dp.DataParallel(Similarity(), ["cpu", "cpu"])(images, texts)
    assert "(5, 5)" in str(err.value) and "outside the wrapper" in str(err.value)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_the_port_the_message_names_is_exact(devices: list[str]) -> None:
    images, texts = torch.randn(5, 4), torch.randn(5, 5)
    ref = Similarity()
    model = copy.deepcopy(ref)
    model.inside = False
    a, b = dp.DataParallel(model, devices)(images, texts)
    logits = a @ b.t()
    want = ref(images, texts)
    assert_close_rel(logits, want)
    target = torch.arange(5)
    nn.functional.cross_entropy(logits, target).backward()
    nn.functional.cross_entropy(want, target).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close_rel(p.grad, q.grad)


class Packed(nn.Module):
    """deepspeech.pytorch's pattern: pack, run, unpack (``total_length`` optional)."""

    def __init__(self, total: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.total = total

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        total = x.shape[1] if self.total else None
        return pad_packed_sequence(out, batch_first=True, total_length=total)[0]


def test_pad_packed_without_total_length_names_it() -> None:
    x, lengths = torch.randn(4, 6, 3), torch.tensor([6, 5, 2, 2])
    with pytest.raises(ValueError, match=r"total_length=x\.shape\[1\]"):
        dp.DataParallel(Packed(total=False), ["cpu", "cpu"])(x, lengths)
    out = dp.DataParallel(Packed(total=True), ["cpu", "cpu"])(x, lengths)
    assert_close_rel(out, Packed(total=True)(x, lengths))
