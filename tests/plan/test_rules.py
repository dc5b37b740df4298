"""The batch rules of DESIGN.md, each a test: votes, rules, markers, options, consequences."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch

import dataparallel as dp

CPU2 = ["cpu", "cpu"]


def rules(p: dp.Plan) -> dict[str, str]:
    return {e.path: e.rule for e in p.entries}


def test_plan_records_votes_rules_and_reasons() -> None:
    x, y = torch.zeros(10, 3), torch.zeros(10, dtype=torch.long)
    p = dp.plan((x,), {"labels": y}, CPU2)
    assert p.batch_size == 10
    assert p.chunk_sizes == [5, 5]
    assert p.devices == [torch.device("cpu")] * 2
    assert p.votes == [
        dp.Vote("args[0]", 10, "size along dim 0"),
        dp.Vote("kwargs['labels']", 10, "size along dim 0"),
    ]
    assert rules(p) == {"args[0]": "split", "kwargs['labels']": "split"}
    assert all("batch size" in e.why for e in p.entries)
    text = str(p)
    assert "batch size 10" in text and "args[0]" in text and "kwargs['labels']" in text
    assert "2 vote(s) for 10" in text


def test_no_vote_means_batch_of_one() -> None:
    p = dp.plan(("a string", 3, None), None, CPU2)
    assert p.batch_size == 1
    assert p.chunk_sizes == [1]
    assert set(rules(p).values()) == {"broadcast"}


def test_batch_of_zero_is_one_chunk_on_the_first_device() -> None:
    p = dp.plan((torch.zeros(0, 3),), None, CPU2, chunk_sizes=[1, 1])  # no samples to cut
    assert (p.batch_size, p.chunk_sizes, p.waves) == (0, [0], [[0]])
    assert p.devices == [torch.device("cpu")]
    assert "an empty batch: the module runs once, on cpu" in str(p)


def test_seed_003_in_either_order() -> None:
    x1, x2 = torch.zeros(10, 3, 4, 4), torch.zeros(1, 10, 20)
    p = dp.plan((x1, x2), None, CPU2)
    assert (p.batch_size, rules(p)) == (10, {"args[0]": "split", "args[1]": "broadcast"})
    p = dp.plan((x2, x1), None, CPU2)
    assert p.batch_size == 1 and p.chunk_sizes == [1]
    assert rules(p) == {"args[0]": "split", "args[1]": "broadcast"}
    (warning,) = p.warnings
    assert "args[1] has size 10" in warning
    assert "wrap args[0] in dp.Shared(...) if it is not batched" in warning
    # labels beside them settle it either way
    y = torch.zeros(10)
    assert dp.plan((x1, x2, y), None, CPU2).batch_size == 10
    assert dp.plan((x2, x1, y), None, CPU2).batch_size == 10


def test_last_batch_of_one_with_a_lookup_table() -> None:
    x, y, table = torch.zeros(1, 5), torch.zeros(1), torch.zeros(20, 5)
    p = dp.plan((x, y, table), None, CPU2)
    assert p.batch_size == 1
    assert rules(p)["args[2]"] == "broadcast"


def test_images_and_targets_detection_style() -> None:
    images = [torch.zeros(3, 8 + i, 8) for i in range(4)]
    images_same = [torch.zeros(3, 8, 8) for _ in range(4)]
    targets = [{"boxes": torch.zeros(i + 1, 4), "labels": torch.zeros(i + 1)} for i in range(4)]
    for imgs in (images, images_same):
        p = dp.plan((imgs, targets), None, CPU2)
        assert p.batch_size == 4
        assert rules(p) == {"args[0]": "per-sample", "args[1]": "per-sample"}


def test_boxes_of_different_sizes_alone() -> None:
    boxes = [torch.zeros(i + 1, 4) for i in range(6)]
    p = dp.plan(boxes, None, CPU2)
    assert p.batch_size == 6 and rules(p) == {"input": "per-sample"}


def test_sixteen_ndarrays_are_per_sample() -> None:
    p = dp.plan([np.zeros(3) for _ in range(16)], None, CPU2)
    assert p.batch_size == 16 and p.chunk_sizes == [8, 8]
    assert rules(p) == {"input": "per-sample"}


def test_size_list_next_to_a_batch_of_two_is_split() -> None:
    x = torch.zeros(2, 3)
    p = dp.plan((x,), {"size": [8, 8]}, CPU2)
    assert rules(p)["kwargs['size']"] == "per-sample"
    # the documented fixes: a tuple, or dp.Shared
    assert rules(dp.plan((x,), {"size": (8, 8)}, CPU2)) == {
        "args[0]": "split",
        "kwargs['size'][0]": "broadcast",
        "kwargs['size'][1]": "broadcast",
    }
    assert rules(dp.plan((x,), {"size": dp.Shared([8, 8])}, CPU2))["kwargs['size']"] == "broadcast"


def test_four_images_alone_follow_torch_and_warn() -> None:
    images = [torch.zeros(3, 5, 5) for _ in range(4)]
    p = dp.plan((images,), None, CPU2)
    assert p.batch_size == 3
    assert set(rules(p)) == {f"args[0][{i}]" for i in range(4)}
    assert set(rules(p).values()) == {"split"}
    assert any("dp.Split(args[0])" in w for w in p.warnings)
    fixed = dp.plan((dp.Split(images),), None, CPU2)
    assert fixed.batch_size == 4 and rules(fixed) == {"args[0]": "per-sample"}


def test_a_list_of_tensors_of_different_ranks_is_not_samples() -> None:
    """RetinaNet's ``retinanet([images, annotations])``: a ``(5, 3, H, W)`` batch and ``(5, N,
    5)`` boxes are no two samples of one kind, so the list votes for its common size only: no
    tie with its length, no warning. Items of one rank still tie (four images, above)."""
    images, annotations = torch.zeros(5, 3, 8, 8), torch.zeros(5, 3, 5)
    p = dp.plan(([images, annotations],), None, CPU2)
    assert p.batch_size == 5 and p.warnings == []
    assert p.votes == [dp.Vote("args[0]", 5, "common size along dim 0")]
    assert rules(p) == {"args[0][0]": "split", "args[0][1]": "split"}
    # where the other inputs make its length the batch size, it is still cut per sample
    pair = [torch.zeros(3, 4), torch.zeros(3, 2, 2)]
    p = dp.plan((pair, torch.zeros(2), torch.zeros(2)), None, CPU2)
    assert p.batch_size == 2 and rules(p)["args[0]"] == "per-sample"


def test_lookup_tables_outvote_a_small_batch() -> None:
    x, t1, t2 = torch.zeros(4, 3), torch.zeros(20, 5), torch.zeros(20, 5)
    p = dp.plan((x, t1, t2), None, CPU2)
    assert p.batch_size == 20
    (warning,) = p.warnings
    assert warning.startswith("args[0] has size 4")
    fixed = dp.plan((x, dp.Shared(t1), dp.Shared(t2)), None, CPU2)
    assert fixed.batch_size == 4 and fixed.warnings == []


def test_tensor_list_rules() -> None:
    # common size == B: structure, each tensor split (torch's reading)
    a, b = torch.zeros(6, 2), torch.zeros(6, 3)
    p = dp.plan(([a, b], torch.zeros(6)), None, CPU2)
    assert rules(p) == {"args[0][0]": "split", "args[0][1]": "split", "args[1]": "split"}
    # length == B: per-sample
    p = dp.plan(([torch.zeros(3, 2)] * 6, torch.zeros(6), torch.zeros(6)), None, CPU2)
    assert rules(p)["args[0]"] == "per-sample"
    # neither: items follow the rules one by one (broadcast, with a warning)
    p = dp.plan(([torch.zeros(3, 2)] * 4, torch.zeros(6), torch.zeros(6)), None, CPU2)
    assert rules(p)["args[0][0]"] == "broadcast"
    assert "args[0][0]" in p.warnings[0]


def test_sequence_of_another_length_is_broadcast() -> None:
    p = dp.plan((torch.zeros(4, 2), ["a", "b", "c"]), None, CPU2)
    assert rules(p)["args[1]"] == "broadcast"
    assert p.warnings == []  # strings: no warning
    p = dp.plan((torch.zeros(4, 2), torch.zeros(4), [np.zeros(2)] * 3), None, CPU2)
    assert rules(p)["args[2]"] == "broadcast"
    assert "args[2] has a list of 3 items holding tensors" in p.warnings[0]


def test_structure_lists_and_tuples_never_split_apart() -> None:
    x, mask = torch.zeros(4, 2), torch.zeros(4, dtype=torch.bool)
    p = dp.plan(((x, mask), [x, None]), None, CPU2)
    assert rules(p) == {
        "args[0][0]": "split",
        "args[0][1]": "split",
        "args[1][0]": "split",
        "args[1][1]": "broadcast",
    }


def test_nested_namedtuple_dataclass_and_dict_paths() -> None:
    class Pair(NamedTuple):
        image: torch.Tensor
        name: str

    @dataclasses.dataclass
    class Batch:
        pair: Pair
        extra: dict[str, object]

    batch = Batch(Pair(torch.zeros(6, 2), "x"), {"boxes": [torch.zeros(i, 4) for i in range(6)]})
    p = dp.plan((batch,), None, CPU2)
    assert rules(p) == {
        "args[0].pair.image": "split",
        "args[0].pair.name": "broadcast",
        "args[0].extra['boxes']": "per-sample",
    }


def test_shared_never_votes_and_split_decides() -> None:
    x = torch.zeros(8, 2)
    p = dp.plan((dp.Shared(torch.zeros(3, 3)), x), None, CPU2)
    assert [v.path for v in p.votes] == ["args[1]"]
    p = dp.plan((torch.zeros(5), dp.Split(torch.zeros(2, 8), dim=1), torch.zeros(5)), None, CPU2)
    assert p.batch_size == 8 and p.decided_by == "dp.Split at args[1]"


def test_split_of_the_wrong_size_is_an_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"args\[1\]: dp.Split of list\[3\] of int has size 3, "
        r"expected the batch size 4 \(set by batch_size=\)",
    ):
        dp.plan((torch.zeros(4, 2), dp.Split([1, 2, 3])), None, CPU2, batch_size=4)
    with pytest.raises(TypeError, match=r"args\[0\]: dp.Split expected a tensor, an ndarray"):
        dp.plan((dp.Split({"a": 1}),), None, CPU2)


def test_batch_size_option_overrides_the_vote() -> None:
    x1, x2 = torch.zeros(2, 3), torch.zeros(6, 3)
    p = dp.plan((x1, x2), None, CPU2, batch_size=6)
    assert p.decided_by == "batch_size=" and rules(p) == {
        "args[0]": "broadcast",
        "args[1]": "split",
    }


def test_strict_mismatch_is_an_error_naming_the_path() -> None:
    with pytest.raises(
        ValueError,
        match=r"args\[1\]: size 1 along dim 0, expected the batch size "
        r"10 \(voted by args\[0\]\) \(strict=True\)",
    ):
        dp.plan((torch.zeros(10, 2), torch.zeros(1, 2)), None, CPU2, strict=True)
    # 0-dim tensors and dp.Shared are fine under strict
    p = dp.plan(
        (torch.zeros(10, 2), torch.tensor(3.0), dp.Shared(torch.zeros(1, 2))),
        None,
        CPU2,
        strict=True,
    )
    assert p.warnings == []


def test_dim_one() -> None:
    p = dp.plan((torch.zeros(3, 8), torch.zeros(8)), None, CPU2, dim=1)
    assert p.batch_size == 8
    assert rules(p) == {"args[0]": "split", "args[1]": "broadcast"}


def test_fewer_devices_when_the_batch_is_small() -> None:
    p = dp.plan((torch.zeros(2, 3),), None, ["cpu"] * 4)
    assert p.chunk_sizes == [1, 1] and len(p.devices) == 2


def test_chunk_sizes_zero_skips_a_device_and_weights() -> None:
    p = dp.plan((torch.zeros(16, 8),), None, ["cpu"] * 4, chunk_sizes=[2, 0, 10, 4])
    assert p.chunk_sizes == [2, 10, 4] and len(p.devices) == 3
    p = dp.plan((torch.zeros(12, 8),), None, ["cpu"] * 3, weights=[1, 0, 2])
    assert p.chunk_sizes == [4, 8]


def test_waves_under_max_size() -> None:
    p = dp.plan((torch.zeros(16, 8),), None, ["cpu"] * 4, max_size=3)
    assert p.waves == [[2, 2, 2, 2], [2, 2, 2, 2]]
    assert p.chunk_sizes == [4, 4, 4, 4]


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['chunks'\]"):
        dp.plan((torch.zeros(2),), None, CPU2, chunks=[1, 1])


def test_plan_of_many_leaves_has_one_entry_each_and_the_batch_size() -> None:
    batch = {f"k{i}": torch.zeros(4, 1) for i in range(2000)}
    p = dp.plan((batch,), None, CPU2)
    assert p.batch_size == 4 and p.chunk_sizes == [2, 2]
    assert [e.path for e in p.entries] == [f"args[0]['k{i}']" for i in range(2000)]
    assert {e.rule for e in p.entries} == {"split"}
    assert len(p.votes) == 2000


def test_str_plan_shows_the_vote_and_each_leafs_rule() -> None:
    x, table, y = torch.zeros(10, 3), torch.zeros(1, 4), torch.zeros(10)
    p = dp.plan((x, table), {"y": y}, CPU2)
    lines = [line.strip() for line in str(p).splitlines()]
    assert lines[0] == "batch size 10, decided by vote (2 of 3)"
    assert "2 vote(s) for 10: args[0] (size along dim 0), kwargs['y'] (size along dim 0)" in lines
    assert "1 vote(s) for 1: args[1] (size along dim 0)" in lines
    assert "chunk sizes: [5, 5]" in lines
    # one row per leaf: its path, what it is, the rule that decided it and why
    for entry, what in zip(p.entries, ["Tensor[10, 3]", "Tensor[1, 4]", "Tensor[10]"], strict=True):
        row = next(line for line in lines if line.startswith(entry.path + " "))
        assert row.startswith(entry.path) and f" {what} float32 " in row
        assert f" {entry.rule} " in row and row.endswith(entry.why)
    assert [e.rule for e in p.entries] == ["split", "broadcast", "split"]


@pytest.mark.parametrize(
    ("devices", "opts", "error", "match"),
    [
        (CPU2, {"chunk_sizes": [3, 4]}, ValueError, r"chunk_sizes: \[3, 4\] sum to 7, expected"),
        (CPU2, {"chunk_sizes": [10, -2]}, ValueError, r"chunk_sizes\[1\]: expected a non-neg"),
        (CPU2, {"chunk_sizes": [8]}, ValueError, r"chunk_sizes: expected one size per device \(2"),
        (CPU2, {"weights": [0, 0]}, ValueError, r"weights: \[0, 0\] are all zero, expected"),
        ([], {}, ValueError, r"expected at least one device"),
        (["cpu", "tpu"], {}, ValueError, r"device_ids\[1\]: expected a device"),
        (CPU2, {"dtype": "half"}, TypeError, r"dtype: expected a torch.dtype .*got 'half'"),
    ],
)
def test_bad_options_and_devices_through_plan(
    devices: list[str], opts: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        dp.plan((torch.zeros(8, 2),), None, devices, **opts)


def test_iterator_argument_is_an_error_on_more_than_one_device() -> None:
    x = torch.zeros(4, 2)
    for it in (iter([1, 2, 3, 4]), (i for i in range(4))):
        with pytest.raises(
            ValueError, match=r"args\[1\]: an iterator or generator.*list\(\.\.\.\)"
        ):
            dp.plan((x, it), None, CPU2)
    # on one device nothing is shared between chunks: it is passed through
    p = dp.plan((x, iter([1, 2])), None, ["cpu"])
    assert rules(p) == {"args[0]": "split", "args[1]": "broadcast"}


def test_split_of_a_namedtuple_gives_plain_tuples() -> None:
    class Four(NamedTuple):
        a: int
        b: int
        c: int
        d: int

    x = torch.arange(4)
    p = dp.plan((x, dp.Split(Four(1, 2, 3, 4))), None, CPU2)
    assert p.batch_size == 4 and rules(p)["args[1]"] == "per-sample"
    chunks = dp.scatter((x, dp.Split(Four(1, 2, 3, 4))), CPU2)
    assert [c[1] for c in chunks] == [(1, 2), (3, 4)]
    assert all(type(c[1]) is tuple for c in chunks)
    assert [c[0].tolist() for c in chunks] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("dim", [True, False, 1.0, "0"])
def test_dim_must_be_an_int_not_a_bool(dim: object) -> None:
    with pytest.raises((TypeError, ValueError), match=r"dim: expected an int"):
        dp.plan((torch.zeros(3, 4),), None, CPU2, dim=dim)
