"""A forward that swaps a replica's parameters through its ``_parameters`` table.

``torch.func.functional_call`` (MAML's inner step, hypernetworks) swaps a module's
parameters in for one call by ``module._parameters[name] = tensor``, and a weight dropped
out in forward may be written there too (AWD-LSTM's ``WeightDrop``). A replica holds each
parameter as an attribute as well, which shadowed the table: every replica but the module
itself computed with its own weights, silently (the output off by 0.91 and the gradient by
2.6 on every CPU list). Each case against the same module on one device, outputs and
gradients. (``update`` and ``|=`` of the table, and a weight deleted and set again as a plain
tensor, stop 76's probe: the first two off by 1.31, the last a raw ``ValueError`` from the
write-back on ``["cpu:1", "cpu:1"]``.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import dataparallel as dp
from _close import assert_close_rel

DEVICES = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu:1", "cpu:1"], ["cpu"] * 3]


class InnerStep(nn.Module):
    """One inner gradient step on the batch, then the output with the adapted weights (MAML,
    first order), through ``torch.func.functional_call``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.net.named_parameters())
        fast = {name: p - 0.1 * p.tanh() for name, p in params.items()}
        return functional_call(self.net, fast, (x,))


class DroppedWeight(nn.Module):
    """A weight masked in forward and written into the layer's ``_parameters`` (the raw weight
    is what trains), as ``WeightDrop`` does: by an item set, ``update`` or ``|=``."""

    how = "item"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.raw = nn.Parameter(self.lin.weight.detach().clone())
        self.register_buffer("mask", (torch.arange(16).reshape(4, 4) % 3 != 0).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.raw * self.mask
        if self.how == "item":
            self.lin._parameters["weight"] = weight
        elif self.how == "update":
            self.lin._parameters.update(weight=weight)
        else:
            self.lin._parameters |= {"weight": weight}
        return self.lin(x)


class DroppedByUpdate(DroppedWeight):
    how = "update"


class DroppedByOr(DroppedWeight):
    how = "or"


class SetAgain(nn.Module):
    """A weight deleted and set again as a plain tensor in forward, then put back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.lin.weight
        del self.lin.weight
        self.lin.weight = weight * 0.5
        y = self.lin(x)
        del self.lin.weight
        self.lin.weight = weight
        return y


@pytest.mark.parametrize("devices", DEVICES, ids=str)
@pytest.mark.parametrize(
    "model",
    [InnerStep, DroppedWeight, DroppedByUpdate, DroppedByOr, SetAgain],
    ids=lambda m: m.__name__,
)
def test_parameters_swapped_through_the_table_in_forward_are_what_forward_reads(
    model: type[nn.Module], devices: list[str]
) -> None:
    ref = model()
    par = copy.deepcopy(ref)
    wrapper = dp.DataParallel(par, devices)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(6, 4, generator=gen)
        out, want = wrapper(x), ref(x)
        assert_close_rel(out, want, msg=f"output, call {step}")
        out.square().sum().backward()
        want.square().sum().backward()
        theirs = dict(ref.named_parameters())  # (by name: ``SetAgain`` reorders the table)
        for name, p in par.named_parameters():
            q = theirs[name]
            if not q.is_leaf:  # (the masked weight forward wrote into the table: no grad)
                continue
            assert (p.grad is None) == (q.grad is None), f"grad of {name}, call {step}"
            if p.grad is not None:
                assert_close_rel(p.grad, q.grad, msg=f"grad of {name}, call {step}")
                p.grad = q.grad = None


def test_a_parameter_deleted_from_a_replicas_table_is_gone_from_its_attributes() -> None:
    """``del m._parameters[name]`` and ``pop`` drop the attribute a replica also holds, as
    ``nn.Module.__delattr__`` drops a parameter on the module: reading it then fails there as
    it fails on one device, rather than reading the replica's stale tensor."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    replica = dp.replicate(model, ["cpu", "cpu"])[1]
    del replica[0]._parameters["bias"]
    replica[1]._parameters.pop("bias")
    for layer in replica:
        with pytest.raises(AttributeError):
            _ = layer.bias
    assert model[0].bias is not None and model[1].bias is not None
