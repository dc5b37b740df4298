"""``dataparallel.markers``: ``Shared`` and ``Split`` override what the batch rules infer.

Each test runs a module through ``DataParallel`` on two CPU replicas and compares it with the
same module on one device (the oracle); the marker must change what the replicas receive,
never the result.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dataparallel as dp

CPU2 = ["cpu", "cpu"]


class AddTable(nn.Module):
    """``x + table``: the table is the same for every sample, whatever its first dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.shape[0], table.shape[0]))
        return x + table.sum(0)


def test_shared_broadcasts_a_tensor_whose_size_matches_the_batch() -> None:
    x, table = torch.randn(4, 3), torch.randn(4, 3)  # same leading size: it would be split
    module = AddTable()
    expected = module(x, table)
    out = dp.DataParallel(module, CPU2)(x, dp.Shared(table))
    torch.testing.assert_close(out, expected)
    # Without the marker the table is cut with the batch and the sums differ from the oracle.
    unmarked = dp.DataParallel(AddTable(), CPU2)(x, table)
    assert not torch.allclose(unmarked, expected)


def test_shared_passes_a_non_tensor_by_reference() -> None:
    table = [1, 2, 3, 4]
    chunks = dp.scatter((torch.zeros(4, 2), dp.Shared(table)), CPU2)
    assert [c[0].shape[0] for c in chunks] == [2, 2]
    assert all(c[1] is table for c in chunks)


def test_split_cuts_a_list_of_images_by_item_and_matches_one_device() -> None:
    images = [torch.randn(3, 5, 5) for _ in range(4)]  # (3, H, W): channels look like a batch
    chunks = dp.scatter((dp.Split(images),), CPU2)
    assert [len(c[0]) for c in chunks] == [2, 2]
    rejoined = [img for c in chunks for img in c[0]]
    for got, want in zip(rejoined, images, strict=True):
        torch.testing.assert_close(got, want)


def test_split_dim_cuts_along_the_given_dimension() -> None:
    x = torch.arange(12.0).view(2, 6)  # the batch of 6 is on dim 1
    chunks = dp.scatter((dp.Split(x, dim=1),), CPU2)
    assert [tuple(c[0].shape) for c in chunks] == [(2, 3), (2, 3)]
    torch.testing.assert_close(torch.cat([c[0] for c in chunks], 1), x)


def test_the_first_split_sets_the_batch_size() -> None:
    other, marked = torch.zeros(4, 2), torch.arange(6.0).view(3, 2)
    with pytest.warns(UserWarning, match=r"set by dp\.Split at args\[1\]"):
        chunks = dp.scatter((other, dp.Split(marked)), CPU2)
    assert [c[1].shape[0] for c in chunks] == [2, 1]
    assert all(c[0].shape == (4, 2) for c in chunks)  # not the batch: broadcast whole


def test_two_splits_of_different_sizes_are_an_error() -> None:
    with pytest.raises(ValueError, match="Split"):
        dp.scatter((dp.Split(torch.zeros(4, 2)), dp.Split(torch.zeros(3, 2))), CPU2)


@pytest.mark.parametrize(
    ("marker", "text"),
    [
        (dp.Shared([8, 8]), "Shared([8, 8])"),
        (dp.Split([1, 2]), "Split([1, 2])"),
        (dp.Split([1, 2], dim=1), "Split([1, 2], dim=1)"),
    ],
)
def test_markers_show_what_they_hold(marker: object, text: str) -> None:
    assert repr(marker) == text
