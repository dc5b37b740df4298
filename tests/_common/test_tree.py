"""Tests of the tree vocabulary in ``dataparallel._common``: the kinds (``kinds``), flatten with
paths and the walks (``tree``), rebuild (``rebuild``) and ``describe``."""

from __future__ import annotations

import dataclasses
import types
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from _odd_containers import Batch, Named, Ordered, PairT
from dataparallel import Shared, Split
from dataparallel._common.describe import describe
from dataparallel._common.kinds import (
    ARRAY,
    BOOL,
    DATACLASS,
    LIST,
    MAPPING,
    NAMEDTUPLE,
    NONE,
    NUMBER,
    OTHER,
    RECORD,
    SHAPE,
    TENSOR,
    TUPLE,
    container_kind,
    item_types,
    kind_of,
    path_key,
    struct_items,
)
from dataparallel._common.rebuild import rebuild
from dataparallel._common.tree import (
    MAX_DEPTH,
    TooDeep,
    contains_array,
    flatten,
    leaves,
    map_leaves,
    map_tensors,
    unflatten,
)

Point = namedtuple("Point", "x y")


@dataclasses.dataclass
class Sample:
    image: Any
    label: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: Any
    b: Any = dataclasses.field(default=None, init=False)


@dataclasses.dataclass
class Output(OrderedDict):  # type: ignore[type-arg]
    """A model-output class: a Mapping that is also a dataclass."""

    logits: Any = None
    loss: Any = None

    def __post_init__(self) -> None:  # as transformers' ModelOutput: set fields are items
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


class Slotted(list):  # type: ignore[type-arg]
    __slots__ = ("tag",)


def test_one_vocabulary_of_kinds() -> None:
    cases = [
        (None, NONE),
        (torch.zeros(2), TENSOR),
        (np.zeros(2), ARRAY),
        (True, BOOL),
        (np.bool_(True), BOOL),
        (3, NUMBER),
        (np.float32(1.5), NUMBER),
        (torch.Size([2, 3]), SHAPE),
        ([1], LIST),
        (Named("n", [1]), LIST),
        ((1,), TUPLE),
        (Point(1, 2), NAMEDTUPLE),
        ({"a": 1}, MAPPING),
        (types.MappingProxyType({"a": 1}), MAPPING),
        (Sample(1, 2), DATACLASS),
        (Output(logits=1), RECORD),
        ("text", OTHER),
        (Sample, OTHER),  # a dataclass type is not an instance
    ]
    for value, kind in cases:
        assert kind_of(value) == kind, value


def test_container_kind_is_what_a_walker_sees() -> None:
    assert container_kind(Output(logits=1)) == MAPPING  # walked by key, as users index it
    assert container_kind(torch.Size([2])) == TUPLE
    assert container_kind(Sample(1, 2)) == DATACLASS
    for leaf in (None, torch.zeros(1), np.zeros(1), 1.0, "s", b"b", Shared(1), Sample):
        assert container_kind(leaf) is None


def test_struct_items_keep_dict_order_as_given() -> None:
    d = {"b": 1, "a": 2, "c": 3}
    assert struct_items(d, MAPPING) == (["b", "a", "c"], [1, 2, 3])
    assert struct_items(Point(1, 2), NAMEDTUPLE) == (["x", "y"], [1, 2])
    assert struct_items(Sample(1, 2), DATACLASS) == (["image", "label"], [1, 2])
    leaves_out, spec = flatten(d)
    assert leaves_out == [1, 2, 3]
    assert list(unflatten(spec, [4, 5, 6])) == ["b", "a", "c"]


def test_path_keys() -> None:
    assert path_key(LIST, 0) == "[0]"
    assert path_key(MAPPING, "boxes") == "['boxes']"
    assert path_key(DATACLASS, "image") == ".image"
    assert path_key(NAMEDTUPLE, "x") == ".x"


def test_flatten_with_paths_and_back() -> None:
    tree = {
        "x": [torch.ones(2), torch.zeros(3)],
        "s": Sample(torch.ones(1), "cat"),
        "p": Point(1, 2),
    }
    paths: list[str] = []
    out, spec = flatten(tree, paths=paths, root="batch")
    assert paths == [
        "batch['x'][0]",
        "batch['x'][1]",
        "batch['s'].image",
        "batch['s'].label",
        "batch['p'].x",
        "batch['p'].y",
    ]
    assert spec is not None and spec.num_leaves == len(out) == 6
    back = unflatten(spec, [v * 2 for v in out])
    assert torch.equal(back["x"][1], torch.zeros(3))
    assert back["s"].label == "catcat" and type(back["s"]) is Sample
    assert back["p"] == Point(2, 4)


def test_a_leaf_flattens_to_itself() -> None:
    out, spec = flatten(5)
    assert out == [5] and spec is None
    assert unflatten(spec, [7]) == 7


def test_is_leaf_stops_the_walk() -> None:
    tree = {"a": [1, 2], "b": [3]}
    out, spec = flatten(tree, is_leaf=lambda o: isinstance(o, list))
    assert out == [[1, 2], [3]]
    assert unflatten(spec, ["x", "y"]) == {"a": "x", "b": "y"}
    assert next(leaves(tree, is_leaf=lambda o: isinstance(o, list))) == [1, 2]


def test_subclasses_rebuilt_without_their_constructor() -> None:
    named = Named("boxes", [1, 2])
    batch = Batch(meta="m", x=1, y=2)
    ordered = Ordered("t", [("a", 1)])
    pair = PairT(1, 2)
    pair.note = "kept"  # type: ignore[attr-defined]
    for obj in (named, batch, ordered, pair):
        kind = container_kind(obj)
        assert kind is not None
        keys, values = struct_items(obj, kind)
        new = rebuild(kind, obj, keys, [v * 10 for v in values])
        assert type(new) is type(obj)
        assert new.__dict__ == obj.__dict__
    assert map_leaves(lambda v: v + 1, named) == [2, 3]
    assert map_leaves(lambda v: v + 1, batch).meta == "m"


def test_slots_and_defaultdict_kept() -> None:
    slotted = Slotted([1])
    slotted.tag = "t"
    new = map_leaves(str, slotted)
    assert new == ["1"] and type(new) is Slotted and new.tag == "t"
    dd: defaultdict[str, Any] = defaultdict(list, {"a": 1})
    back = map_leaves(lambda v: v * 2, dd)
    assert type(back) is defaultdict and back.default_factory is list and back == {"a": 2}


def test_mapping_proxy_and_records() -> None:
    proxy = types.MappingProxyType({"b": 1, "a": 2})
    back = map_leaves(lambda v: -v, proxy)
    assert type(back) is types.MappingProxyType and list(back.items()) == [("b", -1), ("a", -2)]
    out = Output(logits=torch.ones(2))
    moved = map_tensors(out, lambda t: t * 3)
    assert type(moved) is Output and torch.equal(moved.logits, torch.full((2,), 3.0))
    assert torch.equal(moved["logits"], moved.logits) and moved.loss is None


def test_frozen_dataclass_with_init_false_field() -> None:
    frozen = Frozen(1)
    object.__setattr__(frozen, "b", 5)
    back = map_leaves(lambda v: v * 2, frozen)
    assert (back.a, back.b) == (2, 10)


def test_torch_size_walked_as_a_tuple_rebuilt_as_a_size() -> None:
    back = map_leaves(lambda v: v + 1, torch.Size([2, 3]))
    assert type(back) is torch.Size and back == torch.Size([3, 4])


def test_map_tensors_unwraps_markers() -> None:
    tree = {"x": Split(torch.ones(2)), "t": Shared([torch.ones(1)]), "n": "name"}
    out = map_tensors(tree, lambda t: t + 1, lambda t: t * 0)
    assert torch.equal(out["x"], torch.full((2,), 2.0))
    assert torch.equal(out["t"][0], torch.zeros(1)) and out["n"] == "name"


def test_contains_array() -> None:
    assert contains_array({"a": [1, (np.zeros(1),)]})
    assert contains_array(Shared([torch.zeros(1)]))
    assert not contains_array({"a": ["s", 1, None]})


def _cycle() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


def _deep(n: int) -> list[Any]:
    tree: list[Any] = [torch.zeros(1)]
    for _ in range(n):
        tree = [tree]
    return tree


@pytest.mark.parametrize("make", [_cycle, lambda: _deep(MAX_DEPTH + 5)])
def test_cycles_and_deep_trees_are_too_deep(make: Any) -> None:
    tree = {"a": make()}
    with pytest.raises(TooDeep, match=r"batch\['a'\]\[.*nested more than 100 levels"):
        flatten(tree, paths=[], root="batch")
    for walk in (
        lambda: flatten(tree),
        lambda: list(leaves(tree)),
        lambda: map_leaves(lambda v: v, tree),
        lambda: map_tensors(tree, lambda t: t),
    ):
        with pytest.raises(TooDeep):
            walk()
    assert isinstance(TooDeep(), ValueError)


def test_a_tree_at_the_depth_limit_is_fine() -> None:
    tree = _deep(MAX_DEPTH - 1)
    out, spec = flatten(tree)
    back = unflatten(spec, [torch.ones(1)])
    for _ in range(MAX_DEPTH):
        back = back[0]
    assert len(out) == 1 and torch.equal(back, torch.ones(1))
    assert contains_array(tree)


def test_describe_short_and_nested() -> None:
    assert describe(torch.zeros(10, 3)) == "Tensor[10, 3] float32"
    assert describe([torch.zeros(1), "a"]) == "list[2] of Tensor/str"
    assert describe({"a": 1}) == "dict with 1 keys"
    assert describe(Shared(None)) == "Shared(None)"
    assert describe({"x": torch.zeros(2, 3)}, nested=True) == "{'x': Tensor(2, 3):float32}"
    assert describe(Sample(np.zeros(2), "c"), nested=True) == (
        "Sample(image=ndarray(2,):float64, label=str)"
    )
    assert describe(list(range(8)), nested=True) == (
        "list[int, int, int, int, int, int, ... 8 items]"
    )
    assert describe(["x" * 10] * 100, nested=True, budget=20).endswith("...")


@pytest.mark.parametrize(
    "items",
    [
        [],
        ["a", "b", "c"],
        [torch.zeros(1), torch.zeros(2, 3)],
        [torch.zeros(1), torch.nn.Parameter(torch.zeros(1))],  # a subclass is another type
        [1, True, 1.0, None, "x"],  # equal values of other types: still three types
        ["a", 1, "b"],  # a mix after the first item
        [1, "a", "b"],  # the first item's type appears once
        (np.zeros(2), np.float64(1.0), Shared(1), Split([1])),
    ],
)
def test_item_types_is_the_set_of_the_items_types(items: Any) -> None:
    got = item_types(items)
    assert got == set(map(type, items)) and type(got) is set
    assert item_types(iter(items)) == got  # any iterable, read once
