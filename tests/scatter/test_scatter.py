"""Scatter executes a plan: chunks, types, devices, casts and gradients."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch

import dataparallel as dp
from dataparallel.plan import plan
from dataparallel.scatter import take

CPU2 = ["cpu", "cpu"]


def test_s1_sixteen_ndarrays_eight_each() -> None:
    arrays = [np.full(3, i) for i in range(16)]
    chunks = dp.scatter(arrays, CPU2)
    assert [len(c) for c in chunks] == [8, 8]
    assert all(isinstance(a, np.ndarray) for c in chunks for a in c)
    assert [int(a[0]) for c in chunks for a in c] == list(range(16))


def test_s2_shared_batch_one_input_is_broadcast() -> None:
    x1, x2 = torch.randn(10, 3, 8, 8), torch.randn(1, 100, 200)
    with pytest.warns(UserWarning, match=r"args\[1\] has size 1 along dim 0"):
        chunks = dp.scatter((x1, x2), CPU2)
    assert [c[0].shape[0] for c in chunks] == [5, 5]
    assert all(c[1] is x2 for c in chunks)  # same device: no copy
    assert torch.equal(torch.cat([c[0] for c in chunks]), x1)


def test_s3_batch_three_shared_input_not_split_two_one() -> None:
    x1, x2 = torch.randn(10, 3), torch.randn(3, 100, 200)
    p = plan((x1, x2), None, CPU2)
    (entry,) = [e for e in p.entries if e.path == "args[1]"]
    assert entry.rule == "broadcast" and "not the batch size 10" in entry.why
    with pytest.warns(UserWarning):
        chunks = dp.scatter((x1, x2), CPU2)
    assert all(c[1].shape == (3, 100, 200) for c in chunks)


def test_s5_chunk_options_and_dtype() -> None:
    x = torch.randn(16, 8)
    assert [c.shape[0] for c in dp.scatter(x, ["cpu"] * 4)] == [4, 4, 4, 4]
    chunks = dp.scatter(x, ["cpu"] * 4, chunk_sizes=[2, 6, 4, 4])
    assert [c.shape[0] for c in chunks] == [2, 6, 4, 4]
    assert torch.equal(torch.cat(chunks), x)
    half = dp.scatter(x, ["cpu"] * 4, dtype=torch.float16)
    assert all(c.dtype == torch.float16 for c in half)
    assert torch.equal(torch.cat(half), x.half())
    assert [c.shape[0] for c in dp.scatter(x, ["cpu"] * 4, max_size=4)] == [4, 4, 4, 4]
    with pytest.raises(
        ValueError,
        match=r"max_size: a batch of 16 on 4 device\(s\) needs chunks "
        r"of up to 4, expected at most 3 per device in one round",
    ):
        dp.scatter(x, ["cpu"] * 4, max_size=3)


def test_dtype_casts_floats_only_and_not_shared() -> None:
    x, y = torch.randn(4, 2), torch.arange(4)
    shared = torch.randn(2, 2)
    table = np.zeros((4, 2), dtype=np.float64)
    (a, b, s, t, seq), _ = take(
        plan(
            (x, y, dp.Shared(shared), table, [torch.randn(2) for _ in range(4)]),
            None,
            CPU2,
            dtype=torch.bfloat16,
        ),
        0,
        2,
        torch.device("cpu"),
    )
    assert a.dtype == torch.bfloat16 and b.dtype == torch.int64
    assert s.dtype == torch.float32 and t.dtype == np.float64
    assert all(item.dtype == torch.bfloat16 for item in seq)


def test_types_are_kept() -> None:
    od = OrderedDict(a=torch.zeros(4, 1), b=["w", "x", "y", "z"])
    chunks = dp.scatter((od, (1, 2)), CPU2)
    assert [type(c[0]) for c in chunks] == [OrderedDict, OrderedDict]
    assert chunks[1][0]["b"] == ["y", "z"]
    assert chunks[0][1] == (1, 2)


def test_non_tuple_input_returns_chunks_themselves() -> None:
    chunks = dp.scatter(torch.arange(6), CPU2)
    assert [c.tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5]]
    chunks = dp.scatter({"x": torch.arange(6)}, CPU2)
    assert [c["x"].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5]]


def test_scatter_kwargs_every_device_gets_every_kwarg() -> None:
    args, kwargs = dp.scatter_kwargs(
        (torch.arange(5),), {"scale": 2.0, "names": list("abcde")}, ["cpu"] * 3
    )
    assert len(args) == len(kwargs) == 3
    assert [k["scale"] for k in kwargs] == [2.0] * 3
    assert [k["names"] for k in kwargs] == [["a", "b"], ["c", "d"], ["e"]]
    # a non-tuple input is one positional argument
    args, kwargs = dp.scatter_kwargs(torch.arange(4), None, CPU2)
    assert [a[0].tolist() for a in args] == [[0, 1], [2, 3]] and kwargs == ({}, {})


def test_markers_inside_a_per_sample_list_are_unwrapped() -> None:
    chunks = dp.scatter(([dp.Shared(i) for i in range(4)], torch.zeros(4)), CPU2)
    assert chunks[1][0] == [2, 3]


def test_gradients_flow_back_through_scatter() -> None:
    x = torch.randn(6, 3, requires_grad=True)
    w = torch.randn(3)
    chunks = dp.scatter((x, [torch.randn(3) for _ in range(6)]), ["cpu"] * 3)
    loss = sum(((c[0] * w).sum(1) ** 2).sum() for c in chunks)
    loss.backward()  # type: ignore[union-attr]
    x2 = x.detach().clone().requires_grad_()
    ((x2 * w).sum(1) ** 2).sum().backward()
    assert torch.allclose(x.grad, x2.grad)  # type: ignore[arg-type]


def test_empty_slice_for_ranks_past_the_batch() -> None:
    p = plan((torch.zeros(3, 2), ["a", "b", "c"], 7), None, ["cpu"] * 5)
    args, _ = take(p, 3, 0, torch.device("cpu"))
    assert args[0].shape == (0, 2) and args[1] == [] and args[2] == 7


def test_warning_shows_once_per_place() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            dp.scatter((torch.zeros(4, 2), torch.zeros(1, 2)), CPU2)
    assert len(caught) == 1


def test_shared_inside_a_per_sample_list_is_moved_but_not_cast() -> None:
    items = [dp.Shared(torch.zeros(3)), dp.Shared(torch.ones(3))]
    chunks = dp.scatter((items, torch.zeros(2, 3)), CPU2, dtype=torch.float16)
    assert [c[0][0].dtype for c in chunks] == [torch.float32, torch.float32]
    assert all(c[1].dtype == torch.float16 for c in chunks)
    # and inside a broadcast list (another length than the batch; 3 votes against 2, so the
    # tensor is the one broadcast, with the warning)
    with pytest.warns(UserWarning, match=r"args\[1\] has size 2 along dim 0"):
        chunks = dp.scatter(
            ([dp.Shared(torch.zeros(1))] * 3, torch.zeros(2, 3)), CPU2, dtype=torch.half
        )
    assert chunks[0][0][0].dtype == torch.float32


def test_split_of_a_namedtuple_gives_plain_tuples() -> None:
    from collections import namedtuple

    four = namedtuple("four", "a b c d")
    chunks = dp.scatter((dp.Split(four(1, 2, 3, 4)),), CPU2)
    assert [c[0] for c in chunks] == [(1, 2), (3, 4)]


def test_an_iterator_shared_by_several_chunks_is_an_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"args\[1\]: an iterator or generator, expected a value "
        r"that 2 chunks can share.*pass list\(...\)",
    ):
        dp.scatter((torch.zeros(4, 2), iter(range(6))), CPU2)
    gen = (i for i in range(3))
    ((_, same),) = dp.scatter((torch.zeros(4, 2), gen), ["cpu"])  # one chunk: nothing races
    assert same is gen


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dim": True}, TypeError, r"dim: expected an int \(the batch dimension\), got True"),
        ({"batch_size": 0}, ValueError, r"batch_size: expected an int >= 1 .*got 0"),
        ({"dtype": "half"}, TypeError, r"dtype: expected a torch.dtype"),
    ],
)
def test_bad_call_options(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        dp.scatter((torch.zeros(4, 2),), CPU2, **kwargs)  # type: ignore[arg-type]


class _NoIndexing(torch.Tensor):
    """A tensor subclass whose indexing means something else: scatter must not index it."""

    def __getitem__(self, index: object) -> torch.Tensor:
        raise AssertionError("scatter indexed a tensor subclass")


@pytest.mark.parametrize("dim", [0, 1])
def test_chunks_are_views_that_carry_gradients_back(dim: int) -> None:
    x = torch.randn(6, 6, requires_grad=True)
    chunks = dp.scatter(x, ["cpu", "cpu", "cpu"], dim=dim)
    for i, c in enumerate(chunks):
        assert c._base is x and torch.equal(c, x.narrow(dim, 2 * i, 2))
    sum((c * (i + 1)).sum() for i, c in enumerate(chunks)).backward()
    expected = torch.arange(1.0, 4.0).repeat_interleave(2)
    assert x.grad is not None
    torch.testing.assert_close(
        x.grad, expected.view(-1, 1).expand(6, 6) if dim == 0 else expected.expand(6, 6)
    )


def test_a_tensor_subclass_is_cut_with_narrow_not_indexing() -> None:
    x = torch.arange(12.0).view(6, 2).as_subclass(_NoIndexing)
    chunks = dp.scatter(x, ["cpu", "cpu"])
    assert [type(c) for c in chunks] == [_NoIndexing, _NoIndexing]
    assert [c.shape[0] for c in chunks] == [3, 3]
    assert torch.equal(chunks[1].as_subclass(torch.Tensor), torch.arange(6.0, 12.0).view(3, 2))
