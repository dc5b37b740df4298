"""A catalogue of bad and surprising inputs to the library's API (issue 14).

Each case is one call a hostile or careless user could make, and the outcome the library
promises for it, in one of three kinds:

- ``ERRORS``: one clear exception of the given type whose message names the argument path
  (``path``) and says how to fix it (``fix``); never a raw traceback from inside torch;
- ``WARNINGS``: the call succeeds with a ``UserWarning`` naming the path and the fix;
- ``HANDLED``: the call does the right thing, checked against the single-device result or the
  input itself (nothing lost, nothing duplicated, types and attributes kept).

The command line's cases live in ``tests/app/test_cli.py`` and its neighbours.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp
from _odd_containers import Batch, Named, Ordered, PairT
from dataparallel.gather import gather
from dataparallel.parallel_apply import parallel_apply
from dataparallel.replicate import replicate

CPU2 = ["cpu", "cpu"]

# torch 2.13 deprecates torch.jit; the catalogue still checks that scripted modules work.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def x10() -> torch.Tensor:
    return torch.arange(50, dtype=torch.float32).reshape(10, 5)


# ----------------------------------------------------------------------------- helper types


class Slotted(list):  # type: ignore[type-arg]
    __slots__ = ("tag",)

    def __init__(self, tag: str, items: Any = ()) -> None:
        super().__init__(items)
        self.tag = tag


class Point(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    data: Any
    label: str = "f"


class ReadOnly(Mapping):  # type: ignore[type-arg]
    """A Mapping whose class takes no dict and supports no item assignment."""

    def __init__(self, *, secret: Any) -> None:
        self._data = {"a": secret}

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __copy__(self) -> ReadOnly:
        raise TypeError("ReadOnly cannot be copied")


class Fn(nn.Module):
    """A module whose forward is ``fn``."""

    def __init__(self, fn: Callable[..., Any], with_param: bool = True) -> None:
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.ones(())) if with_param else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def run(fn: Callable[..., Any], *args: Any, devices: Any = CPU2, **opts: Any) -> Any:
    return dp.DataParallel(Fn(fn), devices, **opts)(*args)


def cyclic_list() -> list[Any]:
    items: list[Any] = [x10()]
    items.append(items)
    return items


def cyclic_dict() -> dict[str, Any]:
    d: dict[str, Any] = {"x": x10()}
    d["self"] = d
    return d


def deep(levels: int) -> Any:
    obj: Any = x10()
    for _ in range(levels):
        obj = [obj]
    return obj


def deep_dict(levels: int) -> Any:
    obj: Any = {"a": torch.zeros(2)}
    for _ in range(levels):
        obj = {"a": obj}
    return obj


def leaf(obj: Any) -> Any:
    while isinstance(obj, dict):
        obj = obj["a"]
    return obj


def raises_in_replica(exc: BaseException) -> Callable[[torch.Tensor], Any]:
    def forward(x: torch.Tensor) -> Any:
        raise exc

    return forward


def scripted_batchnorm() -> nn.Module:
    return torch.jit.script(nn.BatchNorm1d(5))


# ----------------------------------------------------------------------------- errors


@dataclasses.dataclass
class Err:
    id: str
    call: Callable[[], Any]
    error: type[BaseException]
    path: str  # a regex the message must contain: the argument path
    fix: str  # a regex the message must contain: how to fix it


ERRORS = [
    # -- the batch rules
    Err("dim-5", lambda: dp.scatter(x10(), CPU2, dim=5), ValueError, r"^dim: 5", r"dim=0"),
    Err("dim-minus-3", lambda: dp.scatter(x10(), CPU2, dim=-3), ValueError, r"^dim: -3", "dim=0"),
    Err("dim-5-plan", lambda: dp.plan((x10(),), None, CPU2, 5), ValueError, "^dim", r"\[-2, 1\]"),
    Err("dim-str", lambda: dp.scatter(x10(), CPU2, dim="0"), TypeError, "^dim", "expected an int"),
    Err(
        "dtype-int",
        lambda: dp.scatter(x10(), CPU2, dtype=torch.int64),
        ValueError,
        "^dtype",
        "cast integer inputs yourself",
    ),
    Err(
        "dtype-bool",
        lambda: dp.plan((x10(),), None, CPU2, dtype=torch.bool),
        ValueError,
        "^dtype",
        "floating-point dtype such as torch.float16",
    ),
    Err(
        "dtype-str",
        lambda: dp.scatter(x10(), CPU2, dtype="float16"),
        TypeError,
        "^dtype",
        "torch.float16",
    ),
    Err(
        "batch-size-larger-than-any-input",
        lambda: dp.scatter(x10(), CPU2, batch_size=20),
        ValueError,
        r"^batch_size: 20.*input is Tensor\[10, 5\]",
        "drop batch_size=",
    ),
    Err(
        "batch-size-0",
        lambda: dp.scatter(x10(), CPU2, batch_size=0),
        ValueError,
        "^batch_size",
        "pass None",
    ),
    Err(
        "batch-size-neg",
        lambda: dp.scatter(x10(), CPU2, batch_size=-1),
        ValueError,
        "^batch_size",
        "pass None",
    ),
    Err(
        "batch-size-float",
        lambda: dp.scatter(x10(), CPU2, batch_size=2.5),
        ValueError,
        "^batch_size",
        "pass None",
    ),
    Err(
        "batch-size-bool",
        lambda: dp.scatter(x10(), CPU2, batch_size=True),
        ValueError,
        "^batch_size",
        "pass None",
    ),
    Err(
        "batch-size-wrapper-unmatched",
        lambda: dp.DataParallel(nn.Linear(5, 2), CPU2, batch_size=7)(x10()),
        ValueError,
        "^batch_size: 7",
        "drop batch_size=",
    ),
    Err(
        "cyclic-list",
        lambda: dp.scatter(cyclic_list(), CPU2),
        ValueError,
        r"^input\[1\]: a list that contains itself",
        "back-reference",
    ),
    Err(
        "cyclic-dict",
        lambda: dp.scatter((cyclic_dict(),), CPU2),
        ValueError,
        r"^args\[0\]\['self'\]",
        r"back-reference \(dp.Shared does not help",
    ),
    Err(
        "cyclic-wrapper",
        lambda: run(lambda x: x, cyclic_list()),
        ValueError,
        r"^args\[0\]\[1\]",
        r"back-reference \(dp.Shared does not help",
    ),
    Err(
        "deep-2000",
        lambda: dp.scatter(deep(2000), CPU2),
        ValueError,
        r"^input: containers nested more than 100",
        "flatten the input",
    ),
    Err(
        "deep-2000-one-device",
        lambda: run(lambda x: 0, deep(2000), devices=["cpu"]),
        ValueError,
        r"^args\[0\]: containers nested",
        "flatten",
    ),
    Err(
        "nested-tensor",
        lambda: dp.scatter(torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)]), CPU2),
        TypeError,
        "^input: a nested tensor",
        r"list\(x.unbind\(\)\)",
    ),
    Err(
        "sparse-csr",
        lambda: dp.scatter((x10().to_sparse_csr(),), CPU2),
        TypeError,
        r"^args\[0\]: a tensor of layout torch.sparse_csr",
        "to_dense",
    ),
    Err(
        "mapping-cannot-rebuild",
        lambda: dp.scatter((ReadOnly(secret=x10()),), CPU2),
        TypeError,
        r"^args\[0\]: cannot rebuild a ReadOnly",
        r"pass a dict",
    ),
    Err(
        "split-bad-dim",
        lambda: dp.scatter(dp.Split(x10(), dim=5), CPU2),
        ValueError,
        "^input: dp.Split",
        r"dp.Split\(x, dim=...\)",
    ),
    Err(
        "split-int",
        lambda: dp.scatter(dp.Split(3), CPU2),
        TypeError,
        "^input: dp.Split",
        "wrap only batched",
    ),
    Err(
        "split-wrong-size",
        lambda: dp.scatter((x10(), dp.Split(torch.zeros(4))), CPU2, batch_size=10),
        ValueError,
        r"^args\[1\]: dp.Split",
        "split only inputs of the batch size",
    ),
    Err(
        "strict",
        lambda: dp.scatter((x10(), torch.zeros(3, 2)), CPU2, strict=True),
        ValueError,
        r"^args\[1\]",
        r"dp.Shared",
    ),
    Err(
        "iterator",
        lambda: dp.scatter((x10(), iter([1, 2])), CPU2),
        ValueError,
        r"^args\[1\]",
        r"list\(...\)",
    ),
    Err(
        "kwargs-not-dict",
        lambda: dp.plan((x10(),), [1], CPU2),
        TypeError,
        "^kwargs",
        "dict of keyword",
    ),
    Err(
        "unknown-option",
        lambda: dp.scatter(x10(), CPU2, chunk=[5, 5]),
        TypeError,
        r"\['chunk'\]",
        "expected some of",
    ),
    # -- chunking options
    Err(
        "chunk-sizes-count",
        lambda: dp.scatter(x10(), CPU2, chunk_sizes=[10]),
        ValueError,
        "^chunk_sizes",
        "give 0 for a device",
    ),
    Err(
        "chunk-sizes-sum",
        lambda: dp.scatter(x10(), CPU2, chunk_sizes=[3, 3]),
        ValueError,
        "^chunk_sizes",
        "make them sum to 10",
    ),
    Err(
        "chunk-sizes-neg",
        lambda: dp.scatter(x10(), CPU2, chunk_sizes=[11, -1]),
        ValueError,
        r"^chunk_sizes\[1\]",
        "non-negative",
    ),
    Err(
        "chunk-sizes-and-weights",
        lambda: dp.scatter(x10(), CPU2, chunk_sizes=[5, 5], weights=[1, 1]),
        ValueError,
        "chunk_sizes and weights",
        "drop one",
    ),
    Err(
        "weights-nan",
        lambda: dp.scatter(x10(), CPU2, weights=[float("nan"), 1]),
        ValueError,
        r"^weights\[0\]",
        r"relative",
    ),
    Err(
        "weights-inf",
        lambda: dp.scatter(x10(), CPU2, weights=[float("inf"), 1]),
        ValueError,
        r"^weights\[0\]",
        r"relative",
    ),
    Err(
        "weights-zero",
        lambda: dp.scatter(x10(), CPU2, weights=[0, 0]),
        ValueError,
        "^weights",
        "weight above 0",
    ),
    Err(
        "weights-count",
        lambda: dp.scatter(x10(), CPU2, weights=[1]),
        ValueError,
        "^weights",
        "give 0 for a device",
    ),
    Err(
        "max-size-0",
        lambda: dp.scatter(x10(), CPU2, max_size=0),
        ValueError,
        "^max_size",
        "int >= 1",
    ),
    Err(
        "max-size-one-round",
        lambda: dp.scatter(x10(), CPU2, max_size=2),
        ValueError,
        "^max_size",
        "raise max_size",
    ),
    # -- devices
    Err("devices-empty", lambda: dp.scatter(x10(), []), ValueError, "^device_ids", r"\['cpu'\]"),
    Err(
        "devices-cuda-missing",
        lambda: dp.scatter(x10(), ["cpu", "cuda:7"]),
        ValueError,
        r"^device_ids\[1\]",
        "use 'cpu'",
    ),
    Err(
        "devices-unknown",
        lambda: dp.scatter(x10(), ["tpu"]),
        ValueError,
        r"^device_ids\[0\]",
        "use 'cpu'",
    ),
    Err(
        "devices-bool",
        lambda: dp.scatter(x10(), [True]),
        ValueError,
        r"^device_ids\[0\]",
        "such as 'cpu'",
    ),
    Err(
        "devices-float",
        lambda: dp.scatter(x10(), [1.5]),
        ValueError,
        r"^device_ids\[0\]",
        "an int, a str or a torch.device",
    ),
    Err(
        "meta-wrapper",
        lambda: dp.DataParallel(nn.Linear(5, 2), ["meta", "meta"]),
        ValueError,
        r"^device_ids\[0\]: the meta device",
        "explain",
    ),
    Err(
        "meta-second",
        lambda: dp.DataParallel(nn.Linear(5, 2), ["cpu", "meta"]),
        ValueError,
        r"^device_ids\[1\]",
        "pass real devices",
    ),
    Err(
        "meta-output-device",
        lambda: dp.DataParallel(nn.Linear(5, 2), CPU2, output_device="meta"),
        ValueError,
        "^output_device: the meta device",
        "pass real devices",
    ),
    Err(
        "meta-parallel-apply",
        lambda: parallel_apply([nn.Linear(5, 2)], [x10()], None, ["meta"]),
        ValueError,
        r"^devices\[0\]",
        "pass real devices",
    ),
    # -- the wrapper
    Err(
        "module-none",
        lambda: dp.DataParallel(None),
        TypeError,
        "^module: expected a torch.nn.Module",
        "wrap a function",
    ),  # type: ignore[arg-type]
    Err(
        "module-function",
        lambda: dp.DataParallel(torch.relu, CPU2),
        TypeError,
        "^module: .*a function",
        "nn.Module whose forward",
    ),  # type: ignore[arg-type]
    Err(
        "module-function-functional",
        lambda: dp.data_parallel(len, x10(), CPU2),
        TypeError,
        "^module",
        "wrap a function",
    ),  # type: ignore[arg-type]
    Err(
        "replicate-not-module",
        lambda: replicate(len, CPU2),
        TypeError,
        "^module",
        r"torch.nn.Module",
    ),  # type: ignore[arg-type]
    Err(
        "scalars-bad",
        lambda: dp.DataParallel(nn.Linear(5, 2), CPU2, scalars="avg"),
        ValueError,
        "^scalars",
        r"'mean'",
    ),
    Err(
        "wrapper-chunk-sizes",
        lambda: dp.DataParallel(nn.Linear(5, 2), CPU2, chunk_sizes=[1, 2, 3]),
        ValueError,
        "^chunk_sizes",
        "give 0",
    ),
    Err(
        "wrapper-batch-size-0",
        lambda: dp.DataParallel(nn.Linear(5, 2), CPU2, batch_size=0),
        ValueError,
        "^batch_size",
        "pass None",
    ),
    Err(
        "module-kwargs-list",
        lambda: dp.data_parallel(nn.Linear(5, 2), x10(), CPU2, module_kwargs=[1]),
        TypeError,
        "^module_kwargs",
        r"\{'mask': mask\}",
    ),  # type: ignore[arg-type]
    Err(
        "module-kwargs-str",
        lambda: dp.data_parallel(nn.Linear(5, 2), x10(), CPU2, module_kwargs="x"),
        TypeError,
        "^module_kwargs",
        "tuple",
    ),  # type: ignore[arg-type]
    Err(
        "lazy-module",
        lambda: dp.DataParallel(nn.LazyLinear(2), CPU2)(x10()),
        ValueError,
        r"^module: LazyLinear .* 'weight'",
        "run one forward on the plain module first",
    ),
    Err(
        "lazy-replicate",
        lambda: replicate(nn.Sequential(nn.LazyLinear(2)), CPU2),
        ValueError,
        "^module",
        "run one forward",
    ),
    Err(
        "scripted-with-buffers-cpu",
        lambda: dp.DataParallel(scripted_batchnorm(), CPU2)(x10()),
        ValueError,
        "^devices: a TorchScript module",
        "one device",
    ),
    Err(
        "iterator-wrapper",
        lambda: run(lambda x, it: x, x10(), iter(range(3))),
        ValueError,
        r"^args\[1\]",
        r"list\(...\)",
    ),
    Err(
        "squeezed-output",
        lambda: run(lambda x: (x * 2).squeeze(), torch.arange(6.0).reshape(2, 3)),
        ValueError,
        r"^output: replica 0 returned shape \(3,\) for a chunk of 1",
        r"squeeze\(-1\)",
    ),
    Err(
        "squeezed-output-uneven",
        lambda: run(lambda x: x.sum(1).squeeze(), torch.ones(3, 2)),
        ValueError,
        r"^output: replica 1 returned shape \(\) for a chunk of 1 .*replica 0 has shape \(2,\)",
        "gather=False",
    ),
    Err(
        "partly-batched-output",
        lambda: gather([torch.zeros(2, 5), torch.zeros(3, 5)], "cpu", chunk_sizes=[2, 1]),
        ValueError,
        r"^output: replica 1 returned shape \(3, 5\) for a chunk of 1",
        "gather=False",
    ),
    Err(
        "trailing-shape-differs",
        lambda: run(lambda x: torch.zeros(x.shape[0], 3 + x.shape[0]), torch.ones(3, 2)),
        ValueError,
        r"^output: cannot concatenate .*replica 0 has shape \(2, 5\) for a chunk of 2, "
        r"replica 1 has shape \(1, 4\)",
        "gather=False",
    ),
    Err(
        "trailing-shape-differs-dict",
        lambda: gather(
            [{"y": torch.zeros(2, 3)}, {"y": torch.zeros(2, 4)}], "cpu", chunk_sizes=[2, 2]
        ),
        ValueError,
        r"^output\['y'\]: .*replica 1 has shape \(2, 4\)",
        "gather=False",
    ),
    # -- gather
    Err(
        "gather-scalars",
        lambda: gather([1, 2], "cpu", scalars="max"),
        ValueError,
        "^scalars",
        "'sum'",
    ),  # type: ignore[arg-type]
    Err(
        "gather-not-list",
        lambda: gather(torch.ones(2), "cpu"),
        TypeError,
        "^outputs",
        r"\[output\]",
    ),
    Err("gather-empty", lambda: gather([], "cpu"), ValueError, "^outputs", "at least one"),
    Err(
        "gather-chunk-count",
        lambda: gather([1, 2], "cpu", chunk_sizes=[1]),
        ValueError,
        "^chunk_sizes",
        "plan's chunk_sizes",
    ),
    Err(
        "gather-chunk-neg",
        lambda: gather([1, 2], "cpu", chunk_sizes=[1, -1]),
        ValueError,
        r"^chunk_sizes\[1\]",
        "None to read them",
    ),
    Err(
        "gather-keys",
        lambda: gather([{"a": 1}, {"b": 1}], "cpu"),
        ValueError,
        "^output: replicas disagree on the keys",
        "gather=False",
    ),
    Err(
        "gather-length",
        lambda: gather([(1, 2), (1,)], "cpu"),
        ValueError,
        "^output: replicas disagree on the length",
        "same length",
    ),
    Err(
        "gather-type",
        lambda: gather([{"a": 1}, [1]], "cpu"),
        ValueError,
        "^output: replicas disagree on the type",
        "gather=False",
    ),
    Err(
        "gather-deep",
        lambda: gather([deep(3000), deep(3000)], "cpu"),
        ValueError,
        "^outputs: nested deeper",
        "gather=False",
    ),
    Err(
        "gather-cyclic",
        lambda: gather([cyclic_list(), cyclic_list()], "cpu"),
        ValueError,
        "^outputs: .*contains itself",
        "flatter",
    ),
    Err("gather-dim-bool", lambda: gather([1, 2], "cpu", dim=True), ValueError, "^dim", "an int"),
    Err("gather-target", lambda: gather([1, 2], "tpu"), ValueError, "^target_device", "use 'cpu'"),
    Err(
        "gather-dim-float",
        lambda: gather([1, 2], "cpu", dim=0.5),
        ValueError,
        "^dim",
        "pass e.g. 0",
    ),
    Err(
        "gather-dim-str", lambda: gather([1, 2], "cpu", dim="0"), ValueError, "^dim", "pass e.g. 0"
    ),
    Err(
        "devices-set",
        lambda: dp.scatter(x10(), {"cpu"}),
        TypeError,
        "^device_ids: expected a list of devices, got a set",
        r"\['cpu', 'cpu'\]",
    ),
    Err(
        "devices-dict",
        lambda: dp.DataParallel(nn.Linear(5, 2), {"cpu": 0}),
        TypeError,
        "^device_ids: .*got a dict",
        "pass a list",
    ),
    Err(
        "shared-cyclic",
        lambda: dp.scatter((x10(), dp.Shared(cyclic_list())), CPU2),
        ValueError,
        r"^args\[1\]: containers nested",
        "back-reference",
    ),
    Err(
        "per-sample-cyclic-item",
        lambda: dp.scatter(dp.Split([cyclic_list(), [1]]), CPU2),
        ValueError,
        "^input: containers nested",
        "back-reference",
    ),
    Err(
        "criterion-none",
        lambda: dp.DataParallelCriterion(None),  # type: ignore[arg-type]
        TypeError,
        "^criterion",
        "F.cross_entropy",
    ),
    # -- parallel_apply
    Err(
        "apply-inputs-count",
        lambda: parallel_apply([nn.Linear(5, 2)] * 2, [x10()]),
        ValueError,
        "^inputs",
        "result of scatter",
    ),
    Err(
        "apply-kwargs-count",
        lambda: parallel_apply([nn.Linear(5, 2)], [x10()], [{}, {}]),
        ValueError,
        "^kwargs_tup",
        "pass None",
    ),
    Err(
        "apply-devices-count",
        lambda: parallel_apply([nn.Linear(5, 2)], [x10()], None, CPU2),
        ValueError,
        "^devices",
        "replicas were made for",
    ),
    Err(
        "replica-error",
        lambda: run(raises_in_replica(KeyError("k")), x10()),
        KeyError,
        r"replica 0 on cpu, inputs \(Tensor\[5, 5\]\)",
        r"replicas \[1\] failed too",
    ),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c.id for c in ERRORS])
def test_bad_input_is_one_clear_error(case: Err) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's prototype warnings
        with pytest.raises(case.error) as info:
            case.call()
    message = str(info.value)
    assert re.search(case.path, message), f"no path {case.path!r} in: {message}"
    assert re.search(case.fix, message), f"no fix {case.fix!r} in: {message}"
    assert isinstance(info.value, case.error)


def test_the_catalogue_ids_are_unique() -> None:
    ids = [c.id for c in [*ERRORS, *WARNINGS]] + [name for name, _ in HANDLED]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 60


# ----------------------------------------------------------------------------- warnings


@dataclasses.dataclass
class Warn:
    id: str
    call: Callable[[], Any]
    check: Callable[[Any], bool]  # the result is still right
    path: str
    fix: str


WARNINGS = [
    Warn(
        "int-equal-to-even-chunks",
        lambda: run(lambda x: int(x.shape[0]), torch.ones(4, 2)),
        lambda out: out == 4 and type(out) is int,
        r"^output: every replica returned 2, its chunk size",
        "output_rules=",
    ),
    Warn(
        "broadcast-mismatch",
        lambda: dp.scatter((x10(), torch.zeros(3, 2)), CPU2),
        lambda out: out[0][1].shape == (3, 2) and out[1][1].shape == (3, 2),
        r"^args\[1\] has size 3",
        r"dp.Shared",
    ),
    Warn(
        "seed-003-order",
        lambda: dp.scatter((torch.zeros(1, 4), torch.zeros(10, 3)), CPU2),
        lambda out: len(out) == 1 and out[0][1].shape == (10, 3),
        r"^args\[1\] has size 10",
        r"batch_size=N",
    ),
    Warn(
        "unbatched-different-tensors",
        lambda: gather([torch.zeros(4), torch.ones(4)], "cpu", chunk_sizes=[3, 3]),
        lambda out: out.shape == (8,),
        r"^output: the replicas returned different values",
        "gather=False",
    ),
    Warn(
        "tensor-list-tie",
        lambda: dp.scatter([torch.zeros(3, 8, 8) for _ in range(4)], CPU2),
        lambda out: out[0][0].shape == (2, 8, 8),
        r"^input: a list of 4 tensors",
        r"dp.Split\(input\)",
    ),
]


@pytest.mark.parametrize("case", WARNINGS, ids=[c.id for c in WARNINGS])
def test_surprising_input_warns_and_stays_right(case: Warn) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = case.call()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(re.search(case.path, m) and re.search(case.fix, m) for m in messages), messages
    assert case.check(out)


# ----------------------------------------------------------------------------- handled


def named_roundtrip(devices: list[str]) -> bool:
    batch = Named("imgs", [torch.full((3,), float(i)) for i in range(4)])
    seen: list[Any] = []

    def forward(items: Named) -> Named:
        seen.append((type(items), items.name, len(items)))
        return Named("out", [t * 2 for t in items])

    with warnings.catch_warnings():
        # ``seen`` records what each replica received: its one write per replica is said
        # (a holder the replicas share), and is what this counts
        warnings.filterwarnings("ignore", message="module: forward wrote")
        out = run(forward, dp.Split(batch), devices=devices)
    ok = type(out) is Named and out.name == "out" and len(out) == 4
    ok = ok and all(torch.equal(t, torch.full((3,), 2.0 * i)) for i, t in enumerate(out))
    return (
        ok and all(t is Named and n == "imgs" for t, n, _ in seen) and sum(s[2] for s in seen) == 4
    )


def batch_dict_roundtrip(devices: list[str]) -> bool:
    batch = Batch("meta!", x=x10(), y=torch.arange(10))

    def forward(b: Batch) -> Batch:
        assert type(b) is Batch and b.meta == "meta!" and set(b) == {"x", "y"}
        return Batch(b.meta, out=b["x"] * 2, y=b["y"])

    out = run(forward, batch, devices=devices)
    return (
        type(out) is Batch
        and out.meta == "meta!"
        and torch.equal(out["out"], x10() * 2)
        and torch.equal(out["y"], torch.arange(10))
    )


def chunk_shapes(chunks: list[Any]) -> list[tuple[int, ...]]:
    return [tuple(c.shape) for c in chunks]


def losses_list() -> bool:
    y = torch.arange(4.0)
    out = run(lambda x: [x.mean(), x.pow(2).mean()], y)
    return isinstance(out, list) and len(out) == 2 and torch.allclose(out[0], y.mean())


def strings_still_per_sample() -> bool:
    out = run(lambda x: [f"s{int(v)}" for v in x], torch.arange(4.0))
    return out == ["s0", "s1", "s2", "s3"]


def numbers_list_still_per_sample() -> bool:
    out = run(lambda x: x.tolist(), torch.arange(4.0))
    return out == [0.0, 1.0, 2.0, 3.0]


def no_input_forward() -> bool:
    calls: list[int] = []

    def forward() -> torch.Tensor:
        calls.append(1)
        return torch.ones(3)

    out = dp.data_parallel(Fn(forward), None, CPU2)
    return calls == [1] and torch.equal(out, torch.ones(3))


def cpu1_first() -> bool:
    lin = nn.Linear(5, 2)
    out = dp.DataParallel(lin, ["cpu:1", "cpu"])(x10())
    return torch.allclose(out, lin(x10()), atol=1e-5)


def scripted(kind: str) -> bool:
    lin = nn.Linear(5, 2)
    if kind == "script":
        module: nn.Module = torch.jit.script(lin)
    elif kind == "trace":
        module = torch.jit.trace(lin, x10())
    else:
        module = nn.Sequential(torch.jit.script(lin), nn.ReLU())
    x = x10().requires_grad_()
    out = dp.DataParallel(module, CPU2)(x)
    ref = module(x)
    grad = torch.autograd.grad(out.sum(), x)[0]
    ref_grad = torch.autograd.grad(ref.sum(), x)[0]
    return torch.allclose(out, ref, atol=1e-5) and torch.allclose(grad, ref_grad, atol=1e-5)


def lazy_after_init() -> bool:
    lazy = nn.LazyLinear(2)
    one = dp.DataParallel(lazy, ["cpu"])(x10())  # one device: the module itself, initialized
    two = dp.DataParallel(lazy, CPU2)(x10())
    return torch.allclose(one, two, atol=1e-5)


def sparse_split() -> bool:
    dense = x10()
    chunks = dp.scatter(dense.to_sparse(), CPU2)
    return [c.to_dense().tolist() for c in chunks] == [dense[:5].tolist(), dense[5:].tolist()]


def last_call_per_thread() -> bool:
    model = dp.DataParallel(nn.Linear(5, 2), CPU2)
    seen: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    def work(name: str, batch: int) -> None:
        model(torch.ones(batch, 5))
        barrier.wait()  # both calls done before either reads last_call
        seen[name] = model.last_call.chunk_sizes if model.last_call else None

    threads = [threading.Thread(target=work, args=(n, b)) for n, b in (("a", 4), ("b", 7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return seen == {"a": [2, 2], "b": [4, 3]}


def mapping_proxy() -> bool:
    arg = types.MappingProxyType({"x": x10()})
    out = run(lambda m: m["x"] * 2, arg)
    chunks = dp.scatter((arg,), CPU2)
    return torch.equal(out, x10() * 2) and type(chunks[0][0]) is types.MappingProxyType


def ordered_subclass() -> bool:
    arg = Ordered("t", [("b", x10()), ("a", torch.arange(10))])
    chunks = dp.scatter((arg,), CPU2)
    first = chunks[0][0]
    return type(first) is Ordered and first.tag == "t" and list(first) == ["b", "a"]


def tuple_subclass() -> bool:
    out = run(lambda p: PairT(p[0] * 2, p[1]), PairT(x10(), torch.arange(10)))
    return type(out) is PairT and torch.equal(out[0], x10() * 2) and len(out) == 2


def slotted_list() -> bool:
    chunks = dp.scatter(dp.Split(Slotted("s", [1, 2, 3, 4])), CPU2)
    return (
        [type(c) for c in chunks] == [Slotted] * 2 and chunks[1].tag == "s" and chunks[1] == [3, 4]
    )


def defaultdict_input() -> bool:
    arg: defaultdict[str, Any] = defaultdict(list, {"x": x10()})
    chunk = dp.scatter((arg,), CPU2)[1][0]
    return (
        type(chunk) is defaultdict and chunk.default_factory is list and chunk["x"].shape == (5, 5)
    )


def frozen_and_namedtuple() -> bool:
    out = run(lambda f, p: Frozen(f.data * 2, f.label), Frozen(x10()), Point(1, 2))
    return type(out) is Frozen and torch.equal(out.data, x10() * 2)


def copies_after_a_call() -> bool:
    import copy
    import io

    model = dp.DataParallel(nn.Linear(5, 2), CPU2)
    model(x10())
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ok = clone.last_call is None and loaded.last_call is None  # per thread, not copied
    return ok and torch.allclose(loaded(x10()), model(x10())) and clone(x10()).shape == (10, 2)


def criterion_function() -> bool:
    lin = nn.Linear(5, 2)
    target = torch.zeros(10, 2)
    outs = dp.DataParallel(lin, CPU2, gather=False)(x10())
    loss = dp.DataParallelCriterion(nn.functional.mse_loss, CPU2)(outs, target)
    return bool(torch.allclose(loss, nn.functional.mse_loss(lin(x10()), target), atol=1e-5))


HANDLED: list[tuple[str, Callable[[], bool]]] = [
    ("named-list-one-device", lambda: named_roundtrip(["cpu"])),
    ("named-list-two-devices", lambda: named_roundtrip(CPU2)),
    (
        "named-list-scatter",
        lambda: (
            [(type(c), c.name, len(c)) for c in dp.scatter(Named("n", list("abcd")), CPU2)]
            == [(Named, "n", 2)] * 2
        ),
    ),
    ("batch-dict-one-device", lambda: batch_dict_roundtrip(["cpu"])),
    ("batch-dict-two-devices", lambda: batch_dict_roundtrip(CPU2)),
    ("ordered-dict-subclass", ordered_subclass),
    ("defaultdict", defaultdict_input),
    ("mapping-proxy", mapping_proxy),
    ("tuple-subclass-own-new", tuple_subclass),
    ("list-subclass-with-slots", slotted_list),
    ("frozen-dataclass-and-namedtuple", frozen_and_namedtuple),
    (
        "huge-weights",
        lambda: chunk_shapes(dp.scatter(x10(), CPU2, weights=[1e308, 1e308])) == [(5, 5)] * 2,
    ),
    (
        "huge-and-tiny-weights",
        lambda: chunk_shapes(dp.scatter(x10(), CPU2, weights=[1e308, 1e-308])) == [(10, 5)],
    ),
    (
        "batch-size-wrapper",
        lambda: (
            dp.DataParallel(Fn(lambda x, t: x), CPU2, batch_size=10)(
                x10(), torch.zeros(10, 10)
            ).shape
            == (10, 5)
        ),
    ),
    (
        "batch-size-functional",
        lambda: (
            dp.data_parallel(Fn(lambda x, t: x.sum(1)), (x10(), "text"), CPU2, batch_size=10).shape
            == (10,)
        ),
    ),
    (
        "batch-size-settles-a-tie",
        lambda: (
            run(lambda a, b: [a[0] + s for s in b], ["p"], list("wxyz"), batch_size=4)
            == ["pw", "px", "py", "pz"]
        ),
    ),
    ("data-parallel-none-is-no-input", no_input_forward),
    ("cpu-1-first", cpu1_first),
    ("list-of-losses-is-structure", losses_list),
    ("per-sample-strings-concatenate", strings_still_per_sample),
    ("per-sample-numbers-concatenate", numbers_list_still_per_sample),
    ("scripted-module", lambda: scripted("script")),
    ("traced-module", lambda: scripted("trace")),
    ("python-module-holding-scripted-child", lambda: scripted("child")),
    ("lazy-module-after-one-forward", lazy_after_init),
    ("sparse-coo-split", sparse_split),
    ("last-call-per-thread", last_call_per_thread),
    ("int-scalar-equal-is-a-constant", lambda: run(lambda x: 10, x10()) == 10),
    (
        "int-scalar-sum-mode-silent",
        lambda: run(lambda x: int(x.shape[0]), x10(), scalars="sum") == 10,
    ),
    ("numpy-batch-size", lambda: len(dp.scatter(x10(), CPU2, batch_size=np.int64(10))) == 2),
    (
        "numpy-chunk-sizes",
        lambda: (
            chunk_shapes(dp.scatter(x10(), CPU2, chunk_sizes=np.array([3, 7]))) == [(3, 5), (7, 5)]
        ),
    ),
    (
        "numpy-max-size",
        lambda: len(dp.DataParallel(nn.Linear(5, 2), CPU2, max_size=np.int64(2))(x10())) == 10,
    ),
    (
        "tensor-weights",
        lambda: (
            chunk_shapes(dp.scatter(x10(), CPU2, weights=torch.tensor([1.0, 4.0])))
            == [(2, 5), (8, 5)]
        ),
    ),
    ("criterion-function", criterion_function),
    ("deepcopy-and-pickle-after-a-call", copies_after_a_call),
    (
        "deep-but-allowed",
        lambda: [leaf(c).shape for c in dp.scatter(deep_dict(60), CPU2)] == [(1,)] * 2,
    ),
]


@pytest.mark.parametrize("check", [c for _, c in HANDLED], ids=[n for n, _ in HANDLED])
def test_surprising_input_is_handled(check: Callable[[], bool]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # handled means: no warning either
        warnings.filterwarnings("ignore", message=".*(nested tensors|Lazy modules).*")
        assert check()


# ----------------------------------------------------------------------------- failure paths


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 10:
            raise RuntimeError("boom")
        return self.lin(x)


def test_a_failed_call_leaves_no_reference_cycle() -> None:
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        module, x = Failing(), x10()
        model = dp.DataParallel(module, CPU2)
        replica = replicate(module, CPU2)[1]  # the cached replica the failing call uses
        refs = [weakref.ref(o) for o in (module, x, model, replica, replica.lin)]
        with pytest.raises(RuntimeError, match="replica 0 on cpu"):
            model(x)
        with pytest.raises(RuntimeError, match=r"replica 0 on cpu.*replicas \[1\] failed too"):
            dp.data_parallel(module, x10()[:8], ["cpu", "cpu:1"])
        del module, x, model, replica
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


def test_system_exit_in_a_replica_keeps_its_code() -> None:
    with pytest.raises(SystemExit) as info:
        run(raises_in_replica(SystemExit(3)), x10())
    assert info.value.code == 3
    script = textwrap.dedent(
        """
        import torch, dataparallel as dp
        class M(torch.nn.Module):
            def forward(self, x):
                raise SystemExit(3)
        dp.DataParallel(M(), ["cpu", "cpu"])(torch.ones(4, 2))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 3, done.stderr.decode()[-2000:]


def test_keyboard_interrupt_in_a_replica_stays_one() -> None:
    with pytest.raises(KeyboardInterrupt, match="replica 0 on cpu"):
        run(raises_in_replica(KeyboardInterrupt()), x10())
