"""Tests for dataparallel.gather: every gather rule of DESIGN.md, with plain PyTorch as oracle.

Replicas are simulated by chunking a reference output (or a batch run through a model chunk by
chunk), so every expected value is computed, never typed in.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import types
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dataparallel.gather import gather

CPU = torch.device("cpu")


def chunks(x: torch.Tensor, sizes: list[int], dim: int = 0) -> list[torch.Tensor]:
    return list(x.split(sizes, dim=dim))


# ------------------------------------------------------------------ a model-output class


@dataclass
class FakeModelOutput(OrderedDict):  # type: ignore[type-arg]
    """Like transformers' ModelOutput: a dataclass whose non-None fields are also its items."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)


Pair = namedtuple("Pair", ["logits", "aux"])


@dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor
    name: str = "out"


@dataclass(frozen=True)
class FrozenOut:
    logits: torch.Tensor
    scale: int = 2
    tag: str = field(init=False, default="set-later")

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", f"post-init:{self.scale}")


# ---------------------------------------------------------------------------- rule 1


@pytest.mark.parametrize("sizes", [[3, 2], [4, 1, 2], [2, 2, 2, 1]])
@pytest.mark.parametrize("given", [True, False])
def test_tensors_with_chunk_size_are_concatenated_in_order(sizes: list[int], given: bool) -> None:
    ref = torch.randn(sum(sizes), 4, 3)
    out = gather(chunks(ref, sizes), "cpu", chunk_sizes=sizes if given else None)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [1, -1])
def test_concatenation_along_another_dim(dim: int) -> None:
    ref = torch.randn(2, 7)
    out = gather(chunks(ref, [4, 3], dim=dim), "cpu", dim=dim)
    assert torch.equal(out, ref)


def test_ndarrays_stay_ndarrays_and_concatenate_with_numpy() -> None:
    ref = np.arange(30.0).reshape(10, 3)
    parts = [ref[:6], ref[6:]]
    out = gather(parts, "cpu", chunk_sizes=[6, 4])
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, ref)
    assert isinstance(gather(parts, "cpu"), np.ndarray)  # inferred sizes too


@pytest.mark.parametrize("target", [-1, "cpu", CPU])
def test_target_cpu_spellings(target: Any) -> None:
    ref = torch.randn(5, 2)
    out = gather(chunks(ref, [3, 2]), target)
    assert out.device == CPU
    assert torch.equal(out, ref)


def test_bad_target_device_is_an_error() -> None:
    with pytest.raises(ValueError, match="target_device"):
        gather([torch.zeros(1), torch.zeros(1)], "nonsense")


# ------------------------------------------------------------- chunk sizes, inference


def test_chunk_sizes_are_read_from_the_first_batched_tensor_depth_first() -> None:
    # The first leaf is a 0-dim loss (no batch dimension); the sizes come from "feat".
    feat = torch.randn(7, 4)
    parts = [
        (torch.tensor(1.0), {"feat": f, "labels": [f"s{i}" for i in range(len(f))]})
        for f in chunks(feat, [5, 2])
    ]
    parts[1] = (torch.tensor(8.0), parts[1][1])
    loss, rest = gather(parts, "cpu")
    torch.testing.assert_close(loss, torch.tensor((1.0 * 5 + 8.0 * 2) / 7))
    assert torch.equal(rest["feat"], feat)
    assert rest["labels"] == [f"s{i}" for i in range(5)] + [f"s{i}" for i in range(2)]


def test_unknown_sizes_give_an_unweighted_mean_and_lists_in_replica_order() -> None:
    parts = [
        {"loss": torch.tensor(1.0), "tags": ["a", "b"]},
        {"loss": torch.tensor(4.0), "tags": ["c", "d"]},
    ]
    out = gather(parts, "cpu")
    torch.testing.assert_close(out["loss"], torch.tensor(2.5))
    assert out["tags"] == ["a", "b", "c", "d"]  # sizes unknown: replica order (issue 29, 15)
    given = gather(parts, "cpu", chunk_sizes=[3, 1])
    torch.testing.assert_close(given["loss"], torch.tensor((1.0 * 3 + 4.0) / 4))
    assert given["tags"] == [["a", "c"], ["b", "d"]]  # lengths 2 are not the chunk sizes
    per_sample = gather(parts, "cpu", chunk_sizes=[2, 2])
    assert per_sample["tags"] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("chunk_sizes", "match"),
    [
        ([2], "one size per output"),
        ([2, -1], r"chunk_sizes\[1\]"),
        ([True, 1], r"chunk_sizes\[0\]"),
    ],
)
def test_bad_chunk_sizes(chunk_sizes: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gather([torch.zeros(2), torch.zeros(1)], "cpu", chunk_sizes=chunk_sizes)


def test_bad_outputs_and_scalars_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        gather([], "cpu")
    with pytest.raises(TypeError, match="outputs: expected a list"):
        gather(torch.zeros(2), "cpu")
    with pytest.raises(
        ValueError, match=r"scalars: expected one of .*'mean', 'sum', 'stack'.*'max'"
    ):
        gather([1.0, 2.0], "cpu", scalars="max")  # type: ignore[arg-type]


# -------------------------------------------------------------------------- rule 2


def _model_and_batch(n: int = 7) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(5, 3), torch.randn(n, 5), torch.randint(0, 3, (n,))


@pytest.mark.parametrize("given", [True, False])
def test_weighted_mean_loss_equals_single_device_loss_with_gradients(given: bool) -> None:
    model, x, y = _model_and_batch()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()

    sizes = [3, 2, 2]
    parts = []
    for xc, yc in zip(x.split(sizes), y.split(sizes), strict=True):
        logits = model(xc)
        parts.append({"logits": logits, "loss": F.cross_entropy(logits, yc), "num_classes": 3})
    out = gather(parts, "cpu", chunk_sizes=sizes if given else None)
    torch.testing.assert_close(out["loss"], ref)
    assert out["num_classes"] == 3 and type(out["num_classes"]) is int
    out["loss"].backward()
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_sum_mode_equals_single_device_sum_loss_with_gradients() -> None:
    model, x, y = _model_and_batch()
    ref = F.cross_entropy(model(x), y, reduction="sum")
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    sizes = [4, 3]
    parts = [
        (F.cross_entropy(model(xc), yc, reduction="sum"), len(yc))
        for xc, yc in zip(x.split(sizes), y.split(sizes), strict=True)
    ]
    loss, count = gather(parts, "cpu", chunk_sizes=sizes, scalars="sum")
    torch.testing.assert_close(loss, ref)
    assert count == 7 and type(count) is int
    loss.backward()
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_stack_mode_is_torchs_vector() -> None:
    losses = [torch.tensor(1.5, requires_grad=True), torch.tensor(2.5, requires_grad=True)]
    out = gather(losses, "cpu", scalars="stack")
    assert torch.equal(out, torch.stack(losses))
    out.sum().backward()
    assert all(torch.equal(t.grad, torch.tensor(1.0)) for t in losses)  # type: ignore[arg-type]
    numbers = gather([3, 4.5], "cpu", scalars="stack")
    assert isinstance(numbers, torch.Tensor) and numbers.shape == (2,)
    assert numbers.tolist() == [3.0, 4.5]
    # one replica still gives a vector, so shapes do not depend on the device count
    assert gather([torch.tensor(2.0)], "cpu", scalars="stack").shape == (1,)


def test_constants_come_back_unchanged_with_their_type() -> None:
    assert gather([10, 10], "cpu", chunk_sizes=[3, 1]) == 10
    assert type(gather([10, 10], "cpu", chunk_sizes=[3, 1])) is int
    np_const = gather([np.int64(5), np.int64(5)], "cpu", chunk_sizes=[3, 1])
    assert type(np_const) is np.int64 and np_const == 5
    # Issue 21: an integer tensor is computed from its chunk, a count, summed even when equal
    as_tensor = gather([torch.tensor(7), torch.tensor(7)], "cpu", chunk_sizes=[3, 1])
    assert as_tensor.dtype == torch.int64 and as_tensor.ndim == 0 and as_tensor.item() == 14
    # A float constant is returned bit for bit, where a weighted sum would round it: the sizes
    # are chosen so that it does (checked first, so the test cannot pass by luck).
    sizes = [7, 6, 5]
    for dtype in (torch.float32, torch.float64):
        const = torch.tensor(0.1, dtype=dtype)
        weighted = sum(const * (c / sum(sizes)) for c in sizes)
        assert not torch.equal(weighted, const)
        exact = gather([const.clone() for _ in sizes], "cpu", chunk_sizes=sizes)
        assert exact.dtype == dtype and torch.equal(exact, const)
    assert sum(c * 0.1 for c in sizes) / sum(sizes) != 0.1
    assert gather([0.1, 0.1, 0.1], "cpu", chunk_sizes=sizes) == 0.1


def test_unequal_numbers_are_weighted() -> None:
    assert gather([1.0, 4.0], "cpu", chunk_sizes=[2, 1]) == pytest.approx(2.0)
    # Issues 14 and 21: integers that differ are counts, summed (silently: the rule is sure
    # they are no constant), never made floats.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gather([1, 4], "cpu", chunk_sizes=[2, 1]) == 5
        ints = gather([torch.tensor(1), torch.tensor(4)], "cpu", chunk_sizes=[2, 1])
    assert ints.dtype == torch.int64 and int(ints) == 5
    floats = gather([torch.tensor(1.0), torch.tensor(4.0)], "cpu", chunk_sizes=[1, 2])
    torch.testing.assert_close(floats, torch.tensor(3.0))
    assert (
        gather([2, 3], "cpu", scalars="sum") == 5
        and type(gather([2, 3], "cpu", scalars="sum")) is int
    )


def test_a_loss_that_is_a_python_zero_on_one_replica_mixes_with_tensors() -> None:
    loss = torch.tensor(3.0, requires_grad=True)
    out = gather([0.0, loss], "cpu", chunk_sizes=[1, 2])
    torch.testing.assert_close(out, torch.tensor(2.0))
    out.backward()
    torch.testing.assert_close(loss.grad, torch.tensor(2 / 3))


def test_equal_losses_with_gradients_still_get_weighted_gradients() -> None:
    a, b = torch.tensor(2.0, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    gather([a, b], "cpu", chunk_sizes=[3, 1]).backward()
    torch.testing.assert_close(a.grad, torch.tensor(0.75))
    torch.testing.assert_close(b.grad, torch.tensor(0.25))


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([True, True], True),
        ([False, False, False], False),
        ([np.bool_(True), np.bool_(True)], np.bool_(True)),
    ],
)
def test_booleans_come_back_once_if_equal(values: list[Any], expected: Any) -> None:
    out = gather(values, "cpu", chunk_sizes=[1] * len(values))
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    "values",
    [
        [True, False],
        [np.bool_(False), np.bool_(True)],
        [torch.tensor(True), torch.tensor(False), torch.tensor(True)],
    ],
)
@pytest.mark.parametrize("scalars", ["mean", "sum", "stack"])
def test_booleans_that_differ_are_refused_naming_all_and_any(
    values: list[Any], scalars: str
) -> None:
    # issue 29, item 7: a list [True, False] is truthy where one device says False
    with pytest.raises(ValueError, match="different booleans") as info:
        gather([{"ok": v} for v in values], "cpu", scalars=scalars)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("output['ok']: ")
    assert "replica 0: True" in message or "replica 0: False" in message
    assert """output_rules={"output['ok']": 'all'}""" in message and "'any'" in message


def test_bool_tensors() -> None:
    same = gather([torch.tensor(True), torch.tensor(True)], "cpu")
    assert isinstance(same, torch.Tensor) and same.dtype == torch.bool and bool(same)
    for mode in ("sum", "stack"):  # booleans never add up or stack
        assert gather([True, True], "cpu", scalars=mode) is True  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "rule", "expected"),
    [
        ([True, False], "all", False),
        ([True, False], "any", True),
        ([np.bool_(True), np.bool_(True)], "all", True),
        ([torch.tensor(True), torch.tensor(False)], "all", torch.tensor(False)),
        ([torch.tensor(False), torch.tensor(True)], "any", torch.tensor(True)),
        (
            [torch.tensor([True, False]), torch.tensor([True, True])],
            "all",
            torch.tensor([True, False]),
        ),
        ([np.array([False, False]), np.array([True, False])], "any", np.array([True, False])),
    ],
)
def test_all_and_any_rules_reduce_booleans(values: list[Any], rule: str, expected: Any) -> None:
    out = gather(values, "cpu", output_rules={"output": rule})
    if isinstance(expected, torch.Tensor):
        assert isinstance(out, torch.Tensor) and torch.equal(out, expected)
    elif isinstance(expected, np.ndarray):
        assert isinstance(out, np.ndarray) and np.array_equal(out, expected)
    else:
        assert out is expected


def test_all_and_any_refuse_tensors_of_different_shapes() -> None:
    with pytest.raises(ValueError, match=r"replica 1 has shape \(3,\)"):
        gather([torch.ones(2).bool(), torch.ones(3).bool()], "cpu", output_rules={"output": "all"})


# -------------------------------------------------------------------------- rule 3


def test_equal_unbatched_tensors_come_back_once() -> None:
    table = torch.randn(20, 5)
    sizes = [3, 2]
    parts = [{"y": y, "table": table.clone()} for y in chunks(torch.randn(5, 2), sizes)]
    out = gather(parts, "cpu", chunk_sizes=sizes)
    assert torch.equal(out["table"], table)
    arr = np.arange(6).reshape(2, 3)
    assert np.array_equal(gather([arr, arr.copy()], "cpu", chunk_sizes=[5, 5]), arr)


def test_unequal_unbatched_tensors_are_concatenated_with_a_warning_naming_the_path() -> None:
    sizes = [3, 2]
    attn = [torch.randn(4, 4), torch.randn(4, 4)]
    parts = [
        {"y": y, "attn": a} for y, a in zip(chunks(torch.randn(5, 2), sizes), attn, strict=True)
    ]
    with pytest.warns(UserWarning, match=r"output\['attn'\].*concatenated them along dim 0"):
        out = gather(parts, "cpu")
    assert torch.equal(out["attn"], torch.cat(attn))
    with pytest.warns(UserWarning, match=r"output\[1\]"):
        arrays = gather([(0, np.ones((2, 2))), (0, np.zeros((2, 2)))], "cpu", chunk_sizes=[3, 3])
    assert isinstance(arrays[1], np.ndarray) and arrays[1].shape == (4, 2)
    # Issue 14: with chunks of one sample each, different unbatched outputs are what a squeezed
    # batch dimension looks like: refused, not concatenated.
    with pytest.raises(ValueError, match=r"output\[1\]: replica 0 .* squeeze"):
        gather([(0, np.ones((2, 2))), (0, np.zeros((2, 2)))], "cpu", chunk_sizes=[1, 1])


def test_tensors_that_cannot_be_concatenated_list_every_replicas_shape() -> None:
    parts = [Pair(torch.randn(2, 3), torch.randn(4, 5)), Pair(torch.randn(1, 3), torch.randn(4, 6))]
    with pytest.raises(
        ValueError,
        match=r"output\.aux: cannot concatenate .*replica 0 has shape \(4, 5\), "
        r"replica 1 has shape \(4, 6\)",
    ):
        gather(parts, "cpu")


# -------------------------------------------------------------------------- rule 4


def test_per_sample_list_of_strings_is_concatenated() -> None:
    names = [f"img{i}.png" for i in range(7)]
    sizes = [4, 3]
    parts = [
        {"logits": logits, "names": names[:4] if i == 0 else names[4:]}
        for i, logits in enumerate(chunks(torch.randn(7, 3), sizes))
    ]
    assert gather(parts, "cpu")["names"] == names


def test_list_of_boxes_is_per_sample() -> None:
    boxes = [torch.randn(k, 4) for k in (3, 5, 4)]  # no box count equals a chunk size
    out = gather([boxes[:2], boxes[2:]], "cpu", chunk_sizes=[2, 1])
    assert len(out) == 3
    assert all(torch.equal(a, b) for a, b in zip(out, boxes, strict=True))


def test_list_of_batched_tensors_is_structure() -> None:
    feat, logits = torch.randn(4, 6), torch.randn(4, 3)
    parts = [[f, lg] for f, lg in zip(chunks(feat, [2, 2]), chunks(logits, [2, 2]), strict=True)]
    out = gather(parts, "cpu")  # length 2 equals the chunk size, but the items are batched
    assert isinstance(out, list) and len(out) == 2
    assert torch.equal(out[0], feat) and torch.equal(out[1], logits)


def test_lists_of_other_lengths_are_concatenated() -> None:
    parts = [(torch.zeros(2, 1), ["a", "b", "c"]), (torch.zeros(2, 1), ["d"])]
    assert gather(parts, "cpu")[1] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ([[0], [1]], [0, 1]),
        ([[{"id": 0}], [{"id": 1}]], [{"id": 0}, {"id": 1}]),
        ([[0, 1], [2, 3]], [0, 1, 2, 3]),
        ([["a"], ["b"], ["c", "d"]], ["a", "b", "c", "d"]),
        ([([0.5],), ([0.25],)], ([0.5, 0.25],)),
    ],
)
def test_without_chunk_sizes_lists_are_joined_in_replica_order(parts: Any, expected: Any) -> None:
    # issue 29, item 15: no tensor says the chunk sizes, so nothing tells a per-sample list
    # from structure: each replica's list is kept whole, in replica order (gather_object's)
    assert gather(parts, "cpu") == expected


def test_without_chunk_sizes_lists_of_scalar_tensors_are_still_structure() -> None:
    parts = [[torch.tensor(1.0), torch.tensor(2.0)], [torch.tensor(3.0), torch.tensor(4.0)]]
    out = gather(parts, "cpu")
    assert [float(t) for t in out] == [2.0, 3.0]  # two metrics, each averaged


def test_with_chunk_sizes_lists_follow_them() -> None:
    assert gather([[0], [1]], "cpu", chunk_sizes=[1, 1]) == [0, 1]  # per-sample
    assert gather([[0, 1], [2, 3]], "cpu", chunk_sizes=[3, 3]) == [2, 4]  # structure: counts


@pytest.mark.parametrize("rule", ["sum", "mean"])
def test_sum_and_mean_rules_refuse_shapes_that_differ(rule: str) -> None:
    parts = [torch.ones(1, 5), torch.ones(1, 2, 5)]  # (1, 5) + (1, 2, 5) would broadcast
    with pytest.raises(ValueError, match=rf"output: output_rules says '{rule}'") as info:
        gather(parts, "cpu", output_rules={"output": rule})
    message = str(info.value)
    assert "replica 0 has shape (1, 5)" in message and "replica 1 has shape (1, 2, 5)" in message
    same = gather([torch.ones(2, 5), torch.full((2, 5), 3.0)], "cpu", output_rules={"output": rule})
    assert torch.equal(same, torch.full((2, 5), 4.0 if rule == "sum" else 2.0))


# -------------------------------------------------------------------------- rule 5


def test_namedtuple_keeps_its_type() -> None:
    logits = torch.randn(5, 3)
    parts = [Pair(lg, "same") for lg in chunks(logits, [3, 2])]
    out = gather(parts, "cpu")
    assert type(out) is Pair and out.aux == "same"
    assert torch.equal(out.logits, logits)


def test_tuple_of_outputs() -> None:
    x1, x2 = torch.randn(10, 3, 4, 4), torch.randn(1, 5, 6)
    parts = [(c, x2) for c in chunks(x1, [5, 5])]  # seed 003: a broadcast input returned as is
    out = gather(parts, "cpu")
    assert type(out) is tuple and torch.equal(out[0], x1) and torch.equal(out[1], x2)


def test_dataclass_and_frozen_dataclass_with_init_false_field() -> None:
    logits = torch.randn(5, 3)
    parts = [Out(lg, lg.sum(), "out") for lg in chunks(logits, [3, 2])]
    out = gather(parts, "cpu")
    assert type(out) is Out and out.name == "out" and torch.equal(out.logits, logits)
    torch.testing.assert_close(out.loss, (parts[0].loss * 3 + parts[1].loss * 2) / 5)

    frozen = gather([FrozenOut(lg, 4) for lg in chunks(logits, [3, 2])], "cpu")
    assert type(frozen) is FrozenOut and frozen.scale == 4 and frozen.tag == "post-init:4"
    assert torch.equal(frozen.logits, logits)
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.scale = 3  # type: ignore[misc]


def test_ordered_dict_defaultdict_and_mapping_proxy_keep_their_type() -> None:
    logits = torch.randn(5, 3)
    od = gather([OrderedDict(b=lg, a=1) for lg in chunks(logits, [3, 2])], "cpu")
    assert type(od) is OrderedDict and list(od) == ["b", "a"] and torch.equal(od["b"], logits)

    def make(lg: torch.Tensor) -> defaultdict[str, Any]:
        d: defaultdict[str, Any] = defaultdict(list)
        d["logits"] = lg
        return d

    dd = gather([make(lg) for lg in chunks(logits, [3, 2])], "cpu")
    assert type(dd) is defaultdict and dd.default_factory is list
    assert torch.equal(dd["logits"], logits) and dd["missing"] == []

    proxy = gather([types.MappingProxyType({"y": lg}) for lg in chunks(logits, [3, 2])], "cpu")
    assert type(proxy) is types.MappingProxyType and torch.equal(proxy["y"], logits)


def test_model_output_class_is_rebuilt_as_mapping_and_dataclass() -> None:
    model, x, y = _model_and_batch()
    sizes = [4, 3]
    parts = [
        FakeModelOutput(loss=F.cross_entropy(model(xc), yc), logits=model(xc))
        for xc, yc in zip(x.split(sizes), y.split(sizes), strict=True)
    ]
    out = gather(parts, "cpu")
    assert type(out) is FakeModelOutput
    assert list(out.keys()) == ["loss", "logits"] and out.hidden is None
    assert out.logits is out["logits"] and out.loss is out["loss"]
    torch.testing.assert_close(out.logits, model(x))
    torch.testing.assert_close(out.loss, F.cross_entropy(model(x), y))
    out.loss.backward()
    assert model.weight.grad is not None


def test_nested_dict_holding_a_dataclass() -> None:
    logits = torch.randn(6, 3)
    parts = [{"head": {"out": Out(lg, lg.mean())}, "step": 1} for lg in chunks(logits, [3, 3])]
    out = gather(parts, "cpu")
    assert out["step"] == 1 and type(out["head"]["out"]) is Out
    assert torch.equal(out["head"]["out"].logits, logits)


def test_mismatched_keys_are_an_error_listing_each_replica() -> None:
    parts = [
        {"y": torch.zeros(1), "extra": {"a": 1, "b": 2}},
        {"y": torch.zeros(1), "extra": {"a": 1}},
    ]
    with pytest.raises(
        ValueError,
        match=r"output\['extra'\]: replicas disagree on the keys: "
        r"replica 0 has \['a', 'b'\], replica 1 has \['a'\]",
    ):
        gather(parts, "cpu")


def test_mismatched_length_is_an_error() -> None:
    parts = [(torch.zeros(1), {"boxes": (1, 2)}), (torch.zeros(1), {"boxes": (1,)})]
    with pytest.raises(
        ValueError,
        match=r"output\[1\]\['boxes'\]: replicas disagree on the length: "
        r"replica 0 has length 2, replica 1 has length 1",
    ):
        gather(parts, "cpu")


def test_mismatched_type_is_an_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"output\.aux: replicas disagree on the type: replica 0 has Tensor, "
        r"replica 1 has NoneType",
    ):
        gather([Pair(torch.zeros(1, 2), torch.zeros(3)), Pair(torch.zeros(1, 2), None)], "cpu")
    with pytest.raises(
        ValueError, match=r"output: replicas disagree on the type: .*dict.*OrderedDict"
    ):
        gather([{"a": 1}, OrderedDict(a=1)], "cpu")


# -------------------------------------------------------------------------- rule 6


class Token:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Token) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


class Explosive:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparisons")

    __hash__ = None  # type: ignore[assignment]


class ArrayEq:
    def __eq__(self, other: object) -> Any:
        return np.array([True, True])

    __hash__ = None  # type: ignore[assignment]


def test_other_objects_come_back_once_if_equal_else_one_per_replica() -> None:
    first = Token(1)
    assert gather([first, Token(1)], "cpu") is first
    differ = [Token(1), Token(2)]
    assert gather(differ, "cpu") == differ
    assert gather(["train", "train"], "cpu") == "train"
    assert gather(["a", "b"], "cpu") == ["a", "b"]
    assert gather([None, None], "cpu") is None
    assert gather([None, "x"], "cpu") == [None, "x"]
    shape = torch.Size([2, 3])
    assert gather([shape, torch.Size([2, 3])], "cpu") == shape
    assert gather([shape, torch.Size([1, 3])], "cpu") == [shape, torch.Size([1, 3])]


def test_equality_that_raises_or_is_not_a_bool_counts_as_different() -> None:
    boom = [Explosive(), Explosive()]
    out_boom = gather(boom, "cpu")
    assert isinstance(out_boom, list) and out_boom[0] is boom[0] and out_boom[1] is boom[1]
    arr = [ArrayEq(), ArrayEq()]
    out = gather(arr, "cpu")
    assert isinstance(out, list) and out[0] is arr[0] and out[1] is arr[1]


# -------------------------------------------------------------------------- rule 7


def test_gradients_through_gather_equal_plain_cat_gradients() -> None:
    model, x, _ = _model_and_batch(9)
    weight = torch.randn(9, 3)
    ((model(x) * weight).sum()).backward()
    ref = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    sizes = [4, 3, 2]
    parts = [{"out": Out(model(xc), torch.tensor(0.0), "o")} for xc in x.split(sizes)]
    gathered = gather(parts, "cpu", chunk_sizes=sizes)["out"].logits
    assert gathered.requires_grad and gathered.grad_fn is not None
    (gathered * weight).sum().backward()
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g)


# ------------------------------------------------------------------ one replica, fast


def test_one_replica_returns_its_output_without_copies() -> None:
    logits = torch.randn(4, 3)
    output = {"out": Out(logits, torch.tensor(1.0)), "names": ["a", "b", "c", "d"], "k": 10}
    out = gather([output], "cpu")
    assert out is output  # nothing had to move, so nothing was rebuilt
    assert out["out"].logits.data_ptr() == logits.data_ptr()
    arr = np.zeros((4, 2))
    assert gather([(arr, 3)], -1)[0] is arr


@pytest.mark.cuda
def test_cuda_outputs_gather_to_cpu_and_back() -> None:
    devices = [torch.device("cuda", i % torch.cuda.device_count()) for i in range(2)]
    ref = torch.randn(5, 3, requires_grad=True)
    parts = [
        {"y": c.to(d), "loss": c.to(d).sum()}
        for c, d in zip(chunks(ref, [3, 2]), devices, strict=True)
    ]
    out = gather(parts, -1)
    assert out["y"].device == CPU and torch.equal(out["y"], ref.detach())
    out["loss"].backward()  # the chunk-weighted mean: each row's gradient is its chunk's weight
    expected = torch.cat([torch.full((3, 3), 3 / 5), torch.full((2, 3), 2 / 5)])
    torch.testing.assert_close(ref.grad, expected)
    on_gpu = gather([{"y": p["y"]} for p in parts], 0)
    assert on_gpu["y"].device == devices[0]
    single = gather([{"y": parts[0]["y"]}], devices[0])
    assert single["y"] is parts[0]["y"]


def test_docstring_examples_run() -> None:
    # the package may re-export the function under the module's name, so ask for the module
    module = importlib.import_module("dataparallel.gather._gather")
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_concat_batched_equals_gather_or_declines() -> None:
    from dataparallel.gather import concat_batched

    cpu = torch.device("cpu")
    parts = [torch.randn(2, 3), torch.randn(3, 3)]
    got = concat_batched(parts, cpu, 0, [2, 3])
    assert got is not None and torch.equal(got, gather(parts, cpu, chunk_sizes=[2, 3]))
    assert concat_batched(parts, cpu, -2, [2, 3]) is not None
    # other rules may apply: sizes that are not the chunks', scalars, containers, subclasses
    assert concat_batched(parts, cpu, 0, [3, 2]) is None
    assert concat_batched([torch.tensor(1.0), torch.tensor(2.0)], cpu, 0, [1, 1]) is None
    assert concat_batched([{"y": parts[0]}, {"y": parts[1]}], cpu, 0, [2, 3]) is None
    assert concat_batched([torch.randn(2, 3), torch.randn(3, 4)], cpu, 0, [2, 3]) is None


@pytest.mark.parametrize("infer", [False, True])
def test_a_list_of_items_of_different_kinds_is_structure_on_chunks_of_its_length(
    infer: bool,
) -> None:
    """pix2pixHD's return, ``[losses, None if not infer else fake_image]``, on chunks of 2:
    a list of 2 whose items are a list and ``None`` (or a tensor) is no two samples' records but
    structure, as the batch rules read such an input; before, it came back as ``[losses, None,
    losses, None]``."""
    ys = [torch.randn(2, 3), torch.randn(2, 3)]
    outs = [[[y.mean(), (y * y).mean()], y if infer else None] for y in ys]
    got = gather(outs, "cpu", chunk_sizes=[2, 2])
    whole = torch.cat(ys)
    assert len(got) == 2 and len(got[0]) == 2
    torch.testing.assert_close(got[0][0], whole.mean())
    torch.testing.assert_close(got[0][1], (whole * whole).mean())
    if infer:
        torch.testing.assert_close(got[1], whole)
    else:
        assert got[1] is None
