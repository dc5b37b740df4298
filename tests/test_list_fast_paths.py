"""The whole-list shortcuts of scatter and gather for per-sample lists decide as the
item-by-item rules do: same objects kept, same copies made, same errors raised."""

from __future__ import annotations

import warnings

import pytest
import torch

import dataparallel as dp


def boxes(n: int) -> list[torch.Tensor]:
    """Per-sample tensors whose counts are never a chunk size of these tests."""
    return [torch.rand(k % 3 + 3, 4) for k in range(n)]


def test_scatter_keeps_per_sample_cpu_tensors_on_cpu() -> None:
    items = boxes(6)
    chunks = dp.scatter((items, torch.zeros(6, 2)), ["cpu", "cpu"])
    got = [t for chunk in chunks for t in chunk[0]]
    assert all(a is b for a, b in zip(got, items, strict=True))


def test_scatter_to_cpu_index_0_still_moves_each_item() -> None:
    # device('cpu', 0) is not device('cpu'): the item-by-item rule calls .to, which copies
    items = boxes(4)
    chunks = dp.scatter((items, torch.zeros(4, 2)), ["cpu:0", "cpu:0"])
    got = [t for chunk in chunks for t in chunk[0]]
    assert not any(a is b for a, b in zip(got, items, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got, items, strict=True))


def test_scatter_meta_item_among_cpu_items_still_moves() -> None:
    items = [*boxes(3), torch.zeros(2, 4, device="meta")]
    with pytest.raises(NotImplementedError, match="meta"):
        dp.scatter((items, torch.zeros(4, 2)), ["cpu", "cpu"])


def test_scatter_names_and_markers_in_a_per_sample_list() -> None:
    names = ["a", "b", "c", "d"]
    chunks = dp.scatter((names, torch.zeros(4)), ["cpu", "cpu"])
    assert [c[0] for c in chunks] == [["a", "b"], ["c", "d"]]
    marked = [dp.Shared("a"), dp.Shared("b"), dp.Shared("c"), dp.Shared("d")]
    chunks = dp.scatter((marked, torch.zeros(4)), ["cpu", "cpu"])
    assert [c[0] for c in chunks] == [["a", "b"], ["c", "d"]]


def test_gather_keeps_per_sample_cpu_tensors_for_the_cpu() -> None:
    items = boxes(4)
    out = dp.gather([items[:2], items[2:]], "cpu", chunk_sizes=[2, 2])
    assert all(a is b for a, b in zip(out, items, strict=True))


def test_gather_to_cpu_index_0_still_moves_each_item() -> None:
    items = boxes(4)
    out = dp.gather([items[:2], items[2:]], "cpu:0", chunk_sizes=[2, 2])
    assert not any(a is b for a, b in zip(out, items, strict=True))


def test_gather_meta_items_still_move() -> None:
    items = [torch.zeros(3, 4, device="meta") for _ in range(4)]
    with pytest.raises(NotImplementedError, match="meta"):
        dp.gather([items[:2], items[2:]], "cpu", chunk_sizes=[2, 2])


def test_gather_list_with_a_0_dim_item_is_read_item_by_item() -> None:
    per_sample = [torch.tensor(1.0), torch.zeros(3, 2), torch.zeros(5), torch.zeros(3, 1)]
    out = dp.gather([per_sample[:2], per_sample[2:]], "cpu", chunk_sizes=[2, 2])
    assert all(a is b for a, b in zip(out, per_sample, strict=True))
    # a batched tensor after the 0-dim one: structure, item by item
    values = [[torch.tensor(1.0), torch.zeros(2)], [torch.tensor(3.0), torch.ones(2)]]
    loss, y = dp.gather(values, "cpu", chunk_sizes=[2, 2])
    assert float(loss) == 2.0
    assert torch.equal(y, torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_gather_list_with_a_batched_tensor_is_structure() -> None:
    values = [[torch.zeros(3, 4), torch.zeros(2, 4)], [torch.zeros(3, 4), torch.ones(2, 4)]]
    same, batched = dp.gather(values, "cpu", chunk_sizes=[2, 2])
    assert torch.equal(same, torch.zeros(3, 4))
    assert torch.equal(batched, torch.cat([torch.zeros(2, 4), torch.ones(2, 4)]))


def test_gather_nested_tensors_fail_as_before() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype API's warning
        nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)])
    with pytest.raises(RuntimeError, match="NestedTensorImpl"):
        dp.gather([[nested, nested], [nested, nested]], "cpu", chunk_sizes=[2, 2])


class Names(list):  # type: ignore[type-arg]
    """A list subclass with an attribute: its chunks keep both."""

    tag = "names"


def test_scatter_per_sample_chunks_are_new_lists_of_the_inputs_type() -> None:
    items, names = boxes(6), [f"s{i}" for i in range(6)]
    tagged = Names(names)
    tagged.tag = "mine"
    for whole in (True, False):  # one device (the whole list) and two
        devices = ["cpu"] if whole else ["cpu", "cpu"]
        chunks = dp.scatter((items, names, tagged), devices)
        for (got_items, got_names, got_tagged), (s, e) in zip(
            chunks, [(0, 6)] if whole else [(0, 3), (3, 6)], strict=True
        ):
            assert type(got_items) is list and got_items is not items
            assert all(a is b for a, b in zip(got_items, items[s:e], strict=True))
            assert type(got_names) is list and got_names is not names
            assert got_names == names[s:e]
            assert type(got_tagged) is Names and got_tagged.tag == "mine"
            assert got_tagged == names[s:e]
        chunks[0][1].append("new")  # a chunk is the caller's own list: the input is untouched
        assert names == [f"s{i}" for i in range(6)]
