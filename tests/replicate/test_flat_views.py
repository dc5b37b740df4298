"""Frozen parameters that are views of one flat buffer, written in forward (issue 60, M2).

Some models keep their frozen tensors in one contiguous buffer and the parameters as views of
it (a flat EMA buffer updated with one in-place op, a packed codebook): a write to the buffer
is a write to every view, and a write to one view is a write to the buffer. Each replica after
the first is given copy-on-write clones of the frozen parameters; the clone of one view makes
the module's whole memory copy-on-write again, so the other views' clones looked current after
a write, and their replicas computed later calls from the values before it (12.9 off in a row
of the second call, silently, on 6d4a14e).

The family: which chunks write (every one, or the one holding a flagged sample: a later
replica alone), what the forward writes after reading (the flat buffer in place, one view in
place, one view through ``.data``), what the flat tensor is (a buffer, or a parameter that
does not require grad), on three CPU lists. The oracle is the same model, built from the same
seed, run on one device; each case checks three calls' outputs and the module's state, and
that the module's views still share the buffer's memory.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu", "cpu"]]


class Packed(nn.Module):
    """Two frozen parameters, views of one flat tensor, and a trainable layer."""

    def __init__(self, write: str, base: str, flagged: bool = False) -> None:
        super().__init__()
        self.flagged = flagged  # write only for a chunk that holds a flagged sample
        flat = torch.arange(12.0) / 12
        if base == "buffer":
            self.register_buffer("flat", flat)
        else:
            self.flat = nn.Parameter(flat, requires_grad=False)
        self.a = nn.Parameter(self.flat[:6].view(2, 3), requires_grad=False)
        self.b = nn.Parameter(self.flat[6:].view(2, 3), requires_grad=False)
        self.lin = nn.Linear(3, 3)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x.clamp(max=1.0)) @ self.a.T + x.clamp(max=1.0) @ self.b.T
        if self.flagged and not bool((x[:, 0] > 100).any()):
            return out
        with torch.no_grad():
            if self.write == "flat":
                self.flat.mul_(0.5)
            elif self.write == "view":
                self.a.mul_(0.5)
            else:
                self.b.data.add_(1.0)
        return out


def _cases() -> list[Any]:
    """Every combination but one the guide says is dropped, not landed, when a later replica
    alone makes it: an in-place write through ``.data`` of a replica's own copy on another
    device (it moves no version or address: "A forward that writes its parameters"). A later
    replica's write of the flat tensor where it is a buffer (its private copy) lands as a
    buffer's does (``test_buffer_writes.py``), and its views with it."""
    cases = []
    for devices, ids in zip(DEVICE_LISTS, ["shared", "copied", "three"], strict=True):
        for write in ["flat", "view", "view .data"]:
            for base in ["buffer", "parameter"]:
                for flagged in [False, True]:
                    if flagged and write == "view .data" and ids == "copied":
                        continue
                    name = f"{ids}-{write}-{base}-{'flagged chunk' if flagged else 'every chunk'}"
                    cases.append(pytest.param(devices, write, base, flagged, id=name))
    return cases


@pytest.mark.parametrize(("devices", "write", "base", "flagged"), _cases())
def test_views_of_one_flat_buffer_written_in_forward(
    devices: list[str], write: str, base: str, flagged: bool
) -> None:
    """``flagged chunk``: only the last chunk's sample asks for the write, made by a later
    replica alone, which lands on the module as one device's single write does."""
    torch.manual_seed(0)
    net = Packed(write, base, flagged)
    torch.manual_seed(0)
    oracle = Packed(write, base, flagged)
    model = dp.DataParallel(net, devices)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (replica 0's write is said: not what is tested)
        for call in range(3):
            x = torch.randn(5, 3, generator=gen)
            x[-1, 0] = 1000.0  # (read only where ``flagged``: the last chunk's)
            torch.testing.assert_close(model(x), oracle(x), msg=f"call {call}")
    for name, mine in [*net.named_parameters(), *net.named_buffers()]:
        torch.testing.assert_close(mine, dict(oracle.state_dict())[name], msg=name)
    start = net.flat.untyped_storage().data_ptr()
    assert net.a.untyped_storage().data_ptr() == net.b.untyped_storage().data_ptr() == start


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=["shared", "copied", "three"])
def test_views_written_together_are_said_together(devices: list[str]) -> None:
    """A write of the flat buffer is a write of every view: said once, naming them all, as
    views of one tensor (it said each alone, on 6d4a14e); a write of one view that every
    replica made too (each its own copy) is not said for the other views, whose memory it
    shares but whose values it kept (it said "wrote the parameter 'b'" for a write of 'a')."""
    said = {}
    for write in ("flat", "view"):
        model = dp.DataParallel(Packed(write, "buffer"), devices)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                model(torch.rand(6, 3))
        said[write] = [str(w.message) for w in caught if "forward wrote" in str(w.message)]
    assert len(said["flat"]) == 1, said
    assert said["flat"][0].startswith(
        "module: forward wrote the memory of the parameters 'a', 'b' (they do not require "
        "grad, and are views of one tensor: a write to one is a write to all) in replica 0"
    ), said
    assert said["view"] == []
