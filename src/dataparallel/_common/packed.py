"""``PackedSequence`` as a batch: split by sequence, re-packed on each device, gathered back.

torch's scatter reads a ``PackedSequence`` as the namedtuple it is and cuts its packed
``data`` by rows, which mixes time steps of different sequences into every chunk. Here a
``PackedSequence`` is one batched input whose samples are its sequences: the plan unpacks it
once (``pad_packed_sequence``, sequences back in their original order), each chunk takes a
range of sequences and packs them again on its device (``enforce_sorted=False``, lengths on
the CPU as torch requires), and a ``PackedSequence`` output is unpacked per replica, padded to
one length, concatenated in batch order and packed once more. Every step is differentiable,
so gradients reach the packed input's ``data``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

__all__ = ["gather_packed", "is_packed", "sequence_count", "take_packed"]


def is_packed(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.nn.utils.rnn.PackedSequence``."""
    return isinstance(obj, PackedSequence)


def sequence_count(packed: PackedSequence) -> int:
    """How many sequences ``packed`` holds (its batch size)."""
    return int(packed.batch_sizes[0]) if packed.batch_sizes.numel() else 0


def take_packed(
    padded: torch.Tensor, lengths: torch.Tensor, start: int, length: int, move: Any
) -> PackedSequence:
    """Sequences ``[start, start + length)`` of an unpacked input (``padded`` batch first,
    ``lengths`` on the CPU), packed again on the device."""
    padded = padded.narrow(0, start, length)
    lengths = lengths.narrow(0, start, length)
    longest = int(lengths.max()) if length else 0
    padded = move(padded.narrow(1, 0, longest))  # padding past the chunk's longest is dead
    return pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)


def gather_packed(values: Sequence[PackedSequence], target: torch.device) -> PackedSequence:
    """One ``PackedSequence`` on ``target`` from the replicas' ones, in batch order.

    Each replica's output is unpacked (its sequences in its chunk's order), padded to the
    longest sequence of all replicas, concatenated and packed again; so the result unpacks to
    what the module gives on one device.
    """
    unpacked = [pad_packed_sequence(v, batch_first=True) for v in values]
    longest = max(int(padded.shape[1]) for padded, _ in unpacked)
    chunks = []
    for padded, _ in unpacked:
        padded = padded.to(target)
        missing = longest - int(padded.shape[1])
        if missing:
            pad = padded.new_zeros((padded.shape[0], missing, *padded.shape[2:]))
            padded = torch.cat([padded, pad], 1)
        chunks.append(padded)
    lengths = torch.cat([lengths for _, lengths in unpacked])
    return pack_padded_sequence(
        torch.cat(chunks, 0), lengths, batch_first=True, enforce_sorted=False
    )
