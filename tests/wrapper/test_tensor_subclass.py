"""Tensor subclasses are split and gathered as torch's DataParallel moves them (issue 61, item
3b): never through a subclass's own Python ``to``, not at all where they already are."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

TO_CALLS: list[int] = []


class Distribution(torch.Tensor):
    """ajbrock/BigGAN-PyTorch utils.py: the latent ``z_`` and labels ``y_`` as a tensor that
    samples itself; its ``to`` reads attributes a slice of it does not have."""

    def init_distribution(self, dist_type: str, **kwargs: Any) -> None:
        self.dist_type = dist_type
        self.dist_kwargs = kwargs
        if self.dist_type == "normal":
            self.mean, self.var = kwargs["mean"], kwargs["var"]

    def sample_(self) -> None:
        if self.dist_type == "normal":
            self.normal_(self.mean, self.var)

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        TO_CALLS.append(1)
        new_obj = Distribution(self)
        new_obj.init_distribution(self.dist_type, **self.dist_kwargs)
        new_obj.data = super().to(*args, **kwargs)
        return new_obj


def _z() -> Distribution:
    z = Distribution(torch.zeros(6, 4))
    z.init_distribution("normal", mean=0, var=1.0)
    z = z.to("cpu")  # as BigGAN's prepare_z_y does
    z.sample_()
    return z


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]])
def test_a_subclass_with_its_own_to_is_split_and_gathered_without_it(devices: list[str]) -> None:
    torch.manual_seed(0)
    lin, z = nn.Linear(4, 3), _z()
    want = lin(z)  # a Distribution too (torch's default __torch_function__)
    TO_CALLS.clear()
    out = dp.DataParallel(lin, devices)(z)
    assert TO_CALLS == []
    assert type(out) is Distribution
    assert_close_rel(out.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
    z.sample_()  # the caller's z keeps its attributes
    dp.DataParallel(lin, devices, check="raise")(z)  # and it is one device's call
    assert TO_CALLS == []
