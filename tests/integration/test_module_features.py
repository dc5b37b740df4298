"""Module features real code uses: parametrizations, checkpointing, hooks, tied, frozen and
shared weights. Each against the same module on one device."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.checkpoint import checkpoint

import dataparallel as dp

from ._oracle import LAYOUTS, check, compare, compare_grads, record


def _sq(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _x(batch: int) -> torch.Tensor:
    return torch.randn(batch, 6, generator=torch.Generator().manual_seed(batch))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_parametrizations(devices: list[str], batch: int, kind: str) -> None:
    model = _mlp()
    getattr(parametrizations, kind)(model[0])
    ref, par = check(kind, model, (_x(batch),), {}, _sq, devices)
    if kind == "spectral_norm":  # the power iteration's vectors advance as on one device
        compare(ref[0].parametrizations.weight[0]._u, par[0].parametrizations.weight[0]._u)


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_register_parametrization_before_and_after_the_first_call(
    devices: list[str], batch: int
) -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    check("register_parametrization", model, (_x(batch),), {}, _sq, devices)
    # registered after DataParallel has built its replicas: they are rebuilt, not stale
    ref, par = model, copy.deepcopy(model)
    wrapped = dp.DataParallel(par, devices)
    diff = compare(ref(_x(batch)), wrapped(_x(batch)))
    for m in (ref, par):
        parametrize.register_parametrization(m[2], "weight", nn.Tanh())
        m.zero_grad()
    out_ref, out_par = ref(_x(batch)), wrapped(_x(batch))
    diff = max(diff, compare(out_ref, out_par))
    _sq(out_ref).backward()
    _sq(out_par).backward()
    diff = max(diff, compare_grads(ref, par))
    assert par[2].parametrizations.weight.original.grad is not None
    record("register_parametrization after first call", diff)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.inner, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint(devices: list[str], batch: int, reentrant: bool) -> None:
    x = _x(batch).requires_grad_(reentrant)  # the reentrant form needs an input with grad
    check(f"checkpoint reentrant={reentrant}", Checkpointed(reentrant), (x,), {}, _sq, devices)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_forward_hooks_and_pre_hooks(devices: list[str], batch: int) -> None:
    model = _mlp()
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model[2].register_forward_hook(lambda m, args, out: out + 1)
    model[2].register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    check("forward hooks", model, (_x(batch),), {}, _sq, devices)


class LazyHooks(nn.Module):
    """Registers a forward hook on its first call (transformers' output capture does this)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.hooked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.body[0].register_forward_hook(lambda m, a, out: out * 0.5)
            self.hooked = True
        return self.body(x)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_hook_registered_during_forward_stays_off_the_module(
    devices: list[str], batch: int
) -> None:
    model = LazyHooks()
    wrapped = dp.DataParallel(model, devices)
    wrapped(_x(batch))
    # replica 0 is the module itself and registered one hook; the other replicas' hooks
    # landed on their own tables, not on the module's
    assert len(model.body[0]._forward_hooks) == 1
    ref = LazyHooks()
    ref.load_state_dict(model.state_dict())
    ref(_x(batch))
    record("hook registered in forward", compare(ref(_x(batch)), wrapped(_x(batch))))


class Tied(nn.Module):
    """A language-model head that shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(ids))))


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_tied_weights(devices: list[str], batch: int) -> None:
    ids = torch.randint(0, 11, (batch, 4), generator=torch.Generator().manual_seed(0))
    _, par = check("tied weights", Tied(), (ids,), {}, _sq, devices)
    assert par.out.weight is par.embed.weight


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_frozen_layer(devices: list[str], batch: int) -> None:
    model = _mlp()
    model[0].requires_grad_(False)
    _, par = check("frozen layer", model, (_x(batch),), {}, _sq, devices)
    assert par[0].weight.grad is None and par[2].weight.grad is not None


class TwoBranches(nn.Module):
    """One parameter used twice in a forward, on two paths."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 6)
        self.left = nn.Linear(6, 3)
        self.right = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(torch.tanh(self.shared(x))) * self.right(self.shared(x).sigmoid())


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_parameter_used_in_two_branches(devices: list[str], batch: int) -> None:
    check("parameter in two branches", TwoBranches(), (_x(batch),), {}, _sq, devices)


def test_functional_form_trains_like_the_module() -> None:
    def functional(module: nn.Module, devs: list[str]) -> Any:
        return lambda x: dp.data_parallel(module, x, devs, output_device=-1)

    model = TwoBranches()
    check("data_parallel", model, (_x(7),), {}, _sq, ["cpu", "cpu:1", "cpu:1"], wrap=functional)
    compare_grads(model, model)
