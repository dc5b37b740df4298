"""What the rebinding search reaches (issue 60, items 5-8): dict keys that are modules of the
tree, weak references to it, every standard-library container kind filled after the first
call, and a hook decorated with ``functools.wraps`` of a library function.

Each is the same module on one device, call after call: a counter of calls written on the
module once per call (``+1``), where a replica that reaches the user's module adds one more.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICES = ["cpu", "cpu"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_hook_that_names_modules_through_a_dict_keyed_by_them() -> None:
    """transformers' ``DebugUnderflowOverflow`` style: ``{module: name}``; before: KeyError on
    replica 1, raw."""
    model = Net()
    names = {m: n for n, m in model.named_modules()}
    seen: list[str] = []

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen.append(names[module])

    model.lin.register_forward_hook(hook)
    wrapper = dp.DataParallel(model, DEVICES)
    x = torch.randn(4, 3)
    assert_close_rel(wrapper(x), model.lin(x))
    assert seen[:2] == ["lin", "lin"], seen


class Child(nn.Module):
    def __init__(self, parent: nn.Module) -> None:
        super().__init__()
        self.parent_ref = weakref.ref(parent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parent = self.parent_ref()
        assert parent is not None
        parent.calls += 1
        return x


class WithChild(Net):
    def __init__(self) -> None:
        super().__init__()
        self.child = Child(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(self.lin(x))


def test_a_child_that_holds_its_parent_weakly_writes_its_own_replica() -> None:
    ref = WithChild()
    par = WithChild()
    wrapper = dp.DataParallel(par, DEVICES)
    x = torch.randn(4, 3)
    for step in range(3):
        assert_close_rel(wrapper(x), ref(x))
        assert par.calls == ref.calls == step + 1  # before: +2 per call


def test_a_weak_value_dictionary_of_the_tree_runs_serially_with_a_warning() -> None:
    model = Net()
    registry: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
    registry["model"] = model

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        registry["model"].calls += 1

    model.lin.register_forward_hook(hook)
    wrapper = dp.DataParallel(model, DEVICES)
    with pytest.warns(UserWarning, match="one after another"):  # before: no word
        wrapper(torch.randn(4, 3))


KINDS = {
    "set": (set, lambda h, m: h.add(m), lambda h: next(iter(h))),
    "deque": (collections.deque, lambda h, m: h.append(m), lambda h: h[0]),
    "UserList": (collections.UserList, lambda h, m: h.append(m), lambda h: h[0]),
    "UserDict": (collections.UserDict, lambda h, m: h.__setitem__("m", m), lambda h: h["m"]),
    "ChainMap": (collections.ChainMap, lambda h, m: h.__setitem__("m", m), lambda h: h["m"]),
    "Namespace": (argparse.Namespace, lambda h, m: setattr(h, "m", m), lambda h: h.m),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_container_filled_with_the_module_after_the_first_call(kind: str) -> None:
    make, fill, take = KINDS[kind]

    def build() -> tuple[Net, Any]:
        model = Net()
        holder = make()
        model.lin.register_forward_hook(lambda mod, args, out: _count(holder, take))
        return model, holder

    ref, ref_holder = build()
    par, par_holder = build()
    wrapper = dp.DataParallel(par, DEVICES)
    x = torch.randn(4, 3)
    for step in range(4):
        if step == 1:
            fill(ref_holder, ref)
            fill(par_holder, par)
        wrapper(x)
        ref.lin(x)
        assert par.calls == ref.calls, f"{kind}, call {step}"  # before: +2 per call


def _count(holder: Any, take: Any) -> None:
    if len(holder) if not isinstance(holder, argparse.Namespace) else vars(holder):
        take(holder).calls += 1


@functools.wraps(F.relu)
def _wrapped_hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    for model in _MODEL:  # module-level state of the user's script, filled later
        _LOG.append(model)
        model.calls += 1


_LOG: list[Any] = []
_MODEL: list[Any] = []


def test_a_hook_decorated_with_functools_wraps_of_a_library_function_is_the_users() -> None:
    """Before: its ``__module__`` (``torch.nn.functional``) made it library state, not searched
    nor watched; the list it reads filled after the first call was never compared."""
    ref, par = Net(), Net()
    par.lin.register_forward_hook(_wrapped_hook)
    wrapper = dp.DataParallel(par, DEVICES)
    x = torch.randn(4, 3)
    for step in range(3):
        if step == 1:
            _MODEL.append(par)
        wrapper(x)
        if step >= 1:
            ref.calls += 1
        assert par.calls == ref.calls, f"call {step}"
    _MODEL.clear()
    _LOG.clear()


def test_copy_keeps_the_container_kinds() -> None:
    """The replicas' copies are of the same kinds (a deque keeps its maxlen)."""
    model = Net()
    model.recent = collections.deque([model.lin], maxlen=3)
    replicas = dp.replicate(copy.deepcopy(model), DEVICES)
    recent = replicas[1].recent
    assert type(recent) is collections.deque and recent.maxlen == 3
    assert recent[0] is replicas[1].lin
