"""Properties of scatter then gather over containers with odd constructors (issue 14).

Random nested batches built from list, dict, OrderedDict and tuple subclasses whose
constructors do not take their items first, namedtuples, dataclasses and 0-dim leaves: split
over random device counts and chunk options, passed through an identity replica, and gathered
back. Every sample must come back once, in order, in a container of its own type with its own
attributes; every chunk a replica sees must be of the input's types too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dataparallel as dp
from _odd_containers import Batch, Named, Ordered, PairT
from dataparallel.gather import gather
from dataparallel.plan import plan
from dataparallel.scatter import take

MAX_BATCH = 24


class Point(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass(frozen=True)
class Record:
    value: Any
    label: str = "r"


def attrs(obj: Any) -> dict[str, Any]:
    """The instance attributes of a list, dict or tuple subclass (a dataclass's are fields)."""
    if not isinstance(obj, (list, dict, tuple)):
        return {}
    return dict(getattr(obj, "__dict__", {}))


def _leaf(draw: st.DrawFn, batch: int, counter: list[int]) -> Any:
    counter[0] += 1
    k = counter[0]
    kind = draw(st.sampled_from(["float", "long", "strings", "scalar", "int-scalar", "const"]))
    if kind == "float":  # distinct values: a sample lost, repeated or moved shows
        return torch.arange(batch * 2, dtype=torch.float32).reshape(batch, 2) + 1000 * k
    if kind == "long":
        return torch.arange(batch) + 1000 * k
    if kind == "strings":  # a per-sample list of its own odd type
        return Named(f"n{k}", [f"s{k}-{i}" for i in range(batch)])
    if kind == "scalar":  # 0-dim leaves are broadcast, and come back once
        return torch.tensor(float(k))
    if kind == "int-scalar":
        return torch.tensor(k)
    # A Python constant; never a chunk size (at most MAX_BATCH), which reads as a count of the
    # chunk's samples (int(x.shape[0]), issue 21) and is summed
    return 1000 + k


@st.composite
def batches(draw: st.DrawFn, batch: int, depth: int = 0, counter: list[int] | None = None) -> Any:
    counter = counter if counter is not None else [0]
    if depth >= 3 or draw(st.booleans()):
        return _leaf(draw, batch, counter)
    child = batches(batch, depth + 1, counter)
    kind = draw(
        st.sampled_from(["batch", "ordered", "pair", "point", "record", "named", "dict", "tuple"])
    )
    if kind == "batch":
        return Batch(f"meta{depth}", a=draw(child), b=draw(child))
    if kind == "ordered":
        return Ordered(f"tag{depth}", [("z", draw(child)), ("a", draw(child))])
    if kind == "pair":
        return PairT(draw(child), draw(child))
    if kind == "point":
        return Point(draw(child), draw(child))
    if kind == "record":
        return Record(draw(child), f"label{depth}")
    if kind == "named":  # a structural list: a batched tensor first, so both sides read it so
        return Named(f"struct{depth}", [torch.randn(batch, 3), {"c": draw(child)}])
    if kind == "dict":
        return {"p": draw(child), "q": draw(child)}
    return (draw(child), draw(child))


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Same type, same attributes, same items; tensors equal in value and dtype."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    assert attrs(got) == attrs(want), f"{path}: attributes {attrs(got)} != {attrs(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, Record):
        assert got.label == want.label, path
        assert_same(got.value, want.value, f"{path}.value")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def is_per_sample(obj: Any) -> bool:
    """The generator's per-sample lists are the Named lists of strings (names ``n<k>``)."""
    return isinstance(obj, Named) and not obj.name.startswith("struct")


def assert_types_kept(chunk: Any, want: Any, path: str = "chunk") -> None:
    """A chunk has the input's container types and attributes at every level."""
    assert type(chunk) is type(want), f"{path}: {type(chunk).__name__}"
    assert attrs(chunk) == attrs(want), path
    if isinstance(want, dict):
        assert list(chunk) == list(want), path
        for key in want:
            assert_types_kept(chunk[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, Record):
        assert_types_kept(chunk.value, want.value, f"{path}.value")
    elif isinstance(want, (tuple, list)) and not is_per_sample(want):
        for i, (c, w) in enumerate(zip(chunk, want, strict=True)):
            assert_types_kept(c, w, f"{path}[{i}]")


def has_batched(obj: Any, batch: int) -> bool:
    """Whether anything in ``obj`` votes for ``batch`` (else the plan's B is 1)."""
    if isinstance(obj, torch.Tensor):
        return obj.ndim > 0
    if isinstance(obj, Named) and obj.name.startswith("n"):
        return True
    if isinstance(obj, dict):
        return any(has_batched(v, batch) for v in obj.values())
    if isinstance(obj, Record):
        return has_batched(obj.value, batch)
    if isinstance(obj, (list, tuple)):
        return any(has_batched(v, batch) for v in obj)
    return False


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, MAX_BATCH),
    n=st.integers(1, 5),
    data=st.data(),
    option=st.sampled_from(["even", "max_size", "weights"]),
)
def test_odd_containers_round_trip(batch: int, n: int, data: Any, option: str) -> None:
    args = (data.draw(batches(batch)),)
    opts: dict[str, Any] = {}
    if option == "max_size":
        opts["max_size"] = data.draw(st.integers(1, batch))
    elif option == "weights":
        opts["weights"] = [
            w + 1 for w in data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        ]
    devices = ["cpu"] * n
    p = plan(args, None, devices, **opts)
    if has_batched(args, batch):
        assert p.batch_size == batch
    outputs, sizes = [], []
    for wave in p.slices:
        for device, start, length in wave:
            assert start == sum(sizes)  # contiguous: every sample once, in order
            chunk, _ = take(p, start, length, device)
            assert_types_kept(chunk, args)
            outputs.append(chunk)
            sizes.append(length)
    assert sum(sizes) == p.batch_size
    back = gather(outputs, "cpu", chunk_sizes=sizes)
    assert_same(back, args)


class Identity(nn.Module):
    def forward(self, *args: Any) -> Any:
        return args


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 12), n=st.integers(1, 3), data=st.data())
def test_odd_containers_through_the_wrapper(batch: int, n: int, data: Any) -> None:
    args = (data.draw(batches(batch)),)
    out = dp.DataParallel(Identity(), ["cpu"] * n)(*args)
    assert_same(out, args)


# -- the two readings of a list of the chunk's length (gather rule 4) -------------------------


class Losses(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return [x.mean(), x.pow(2).mean()], [f"id{int(v)}" for v in x[:, 0]]


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 16), n=st.integers(1, 4))
def test_a_list_of_0_dim_tensors_is_structure_and_a_list_of_strings_per_sample(
    batch: int, n: int
) -> None:
    x = torch.arange(batch * 2, dtype=torch.float64).reshape(batch, 2)
    losses, ids = dp.DataParallel(Losses(), ["cpu"] * n)(x)
    assert isinstance(losses, list) and len(losses) == 2  # two losses, whatever the chunks
    torch.testing.assert_close(losses[0], x.mean())
    torch.testing.assert_close(losses[1], x.pow(2).mean())
    assert ids == [f"id{int(v)}" for v in x[:, 0]]  # every sample once, in order


@pytest.mark.parametrize("sizes", [[2, 2], [1, 1], [3, 1, 2]])
def test_a_list_of_0_dim_tensors_is_never_concatenated(sizes: list[int]) -> None:
    parts = [[torch.tensor(float(i)), torch.tensor(10.0 + i)] for i in range(len(sizes))]
    out = gather(parts, "cpu", chunk_sizes=sizes)
    weights = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
    assert len(out) == 2
    torch.testing.assert_close(out[0], (torch.arange(len(sizes)) * weights).sum())
