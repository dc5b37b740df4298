"""A ``scatter`` override in torch's style, and direct ``dp.parallel_apply`` calls: a list per
device is that replica's positional arguments, as torch's ``parallel_apply`` reads it (issue 39,
item 14; semantic-segmentation-pytorch's ``UserScatteredDataParallel``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dataparallel as dp


class SegModel(nn.Module):
    """Takes one dict per call, as semantic-segmentation-pytorch's models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    def forward(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(self.lin(feed["img"]), feed["label"])


class UserScatteredDataParallel(dp.DataParallel):
    """semantic-segmentation-pytorch's override: the caller passes one dict per device, and
    scatter returns one *list* of arguments per device."""

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        assert len(inputs) == 1
        per_device = [
            {k: v.to(d) for k, v in feed.items()}
            for feed, d in zip(inputs[0], device_ids, strict=False)
        ]
        return [[feed] for feed in per_device], [{} for _ in per_device]


def _feeds(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        {"img": torch.randn(3, 4, generator=gen), "label": torch.randint(0, 3, (3,), generator=gen)}
        for _ in range(n)
    ]


def test_a_scatter_override_in_torchs_style() -> None:
    model = SegModel()
    feeds = _feeds(2)
    wrapper = UserScatteredDataParallel(model, ["cpu", "cpu:1"])
    loss = wrapper(feeds)  # before: TypeError, list indices must be integers or slices
    one = [model(f) for f in feeds]
    torch.testing.assert_close(loss, (one[0] + one[1]) / 2)  # equal chunks: the mean


def test_direct_parallel_apply_reads_a_list_as_the_arguments() -> None:
    model = SegModel()
    feeds = _feeds(2)
    outs = dp.parallel_apply([model, model], [[feeds[0]], [feeds[1]]], devices=["cpu", "cpu"])
    for out, feed in zip(outs, feeds, strict=True):
        torch.testing.assert_close(out, model(feed))
    # a tuple was already the arguments, and anything else one argument
    pair = dp.parallel_apply([model, model], [(feeds[0],), feeds[1]], devices=["cpu", "cpu"])
    torch.testing.assert_close(pair[1], model(feeds[1]))


def test_our_own_per_sample_lists_stay_one_argument() -> None:
    """The wrapper's scatter hands each replica a tuple of arguments: a per-sample list in it
    is one argument, as before."""
    seen: list[int] = []

    class Items(nn.Module):
        def forward(self, items: list[str]) -> list[str]:
            seen.append(len(items))
            return [s.upper() for s in items]

    out = dp.DataParallel(Items(), ["cpu", "cpu"])(["a", "b", "c", "d", "e"])
    assert out == ["A", "B", "C", "D", "E"] and sorted(seen) == [2, 3]
    chunks = dp.scatter((["a", "b", "c"],), ["cpu", "cpu"])  # a tuple of arguments per device
    assert dp.parallel_apply([Items(), Items()], chunks, devices=["cpu", "cpu"]) == [
        ["A", "B"],
        ["C"],
    ]
