"""gather's shortcuts for plain tensors decide as its general walk does: the chunk sizes read
from the first tensor of each output, and the tensors already on the target kept as ``.to``
would keep them (tensor subclasses still go through their own ``.to``)."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch

import dataparallel as dp
from dataparallel._common.kinds import ARRAY, TENSOR, kind_of
from dataparallel._common.tree import leaves
from dataparallel.gather import first_batch_size

Pair = namedtuple("Pair", ["a", "b"])


def _walked(obj: Any, dim: int) -> int | None:
    """The general rule: the first tensor or ndarray leaf, depth first, that has ``dim``."""
    for leaf in leaves(obj):
        if kind_of(leaf) in (TENSOR, ARRAY) and -leaf.ndim <= dim < leaf.ndim:
            return int(leaf.shape[dim])
    return None


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
@pytest.mark.parametrize(
    "output",
    [
        torch.zeros(3, 5),
        torch.tensor(2.0),  # 0-dim: no size along any dim
        (torch.zeros(3, 5), torch.zeros(7)),
        [torch.zeros(4), torch.zeros(6, 2)],  # the first lacks dim 1: the second answers
        (torch.tensor(1.0), torch.zeros(2, 3)),
        (np.zeros((5, 1)), torch.zeros(3, 2)),  # an ndarray first
        (torch.nn.Parameter(torch.zeros(2, 2)), torch.zeros(9, 9)),  # a subclass first
        ([torch.zeros(8, 1)], torch.zeros(3)),  # nested: depth first
        Pair(torch.zeros(4, 4), torch.zeros(1)),  # a namedtuple
        {"y": torch.zeros(5, 2)},
        (),
        [],
        ("text", torch.zeros(2, 3)),
        None,
    ],
)
def test_first_batch_size_is_the_walks_answer(output: Any, dim: int) -> None:
    assert first_batch_size(output, dim) == _walked(output, dim)


class Traced(torch.Tensor):
    """A tensor subclass that counts the ``.to`` calls made on it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.to:
            cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_gather_keeps_tensors_on_the_target_subclasses_too() -> None:
    """A tensor already on the target is not moved, a subclass no more than a plain one: torch's
    ``_gather`` calls no ``to`` (issue 61; BigGAN's ``Distribution.to`` fails on a slice)."""
    table = torch.randn(1, 3)
    out = dp.gather([(torch.ones(2, 2), table), (torch.zeros(1, 2), table)], "cpu")
    assert out[1] is table  # unbatched and equal: one replica's own tensor, as before
    traced = torch.randn(1, 3).as_subclass(Traced)
    Traced.calls = 0
    out = dp.gather([(torch.ones(2, 2), traced), (torch.zeros(1, 2), traced)], "cpu")
    assert Traced.calls == 0
    assert out[1] is traced
