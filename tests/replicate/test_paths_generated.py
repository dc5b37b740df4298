"""Every path from user code to a module of the tree, generated (issue 38).

A model's code reaches a stateful submodule (a call counter with a parameter) through a random
path: holders of every kind (list, tuple, dict, OrderedDict, namedtuple, SimpleNamespace,
dataclass, an object of the user's own, a closure, a ``functools.partial``), 1 to 6 deep, from
the class's ``forward``, a forward hook, a forward pre-hook, an instance ``forward`` that wraps
the original bound method, or a module-level name read by a hook or by the class's forward.
Between calls the path may change: its innermost mutable holder retargeted to another
submodule, the hook swapped for another, or a new path assigned. Every output, gradient and
the counters' state must equal the same model run on one device, on the three device lists.
The path may lead to a parameter of the tree instead (a frozen tally, written through it in
forward): each replica must write its own (issue 60, M1).

The oracle is a deep copy of the model run on the whole batch; the rule for state a forward
writes is replica 0's writes, which here equal one device's (each replica counts one call).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import types
import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
KINDS = (
    "list",
    "tuple",
    "dict",
    "odict",
    "namedtuple",
    "namespace",
    "dataclass",
    "object",
    "closure",
    "partial",
    # issue 60: every container kind of the standard library
    "deque",
    "userlist",
    "userdict",
    "chainmap",
    "argns",
)
MUTABLE = (
    "list",
    "dict",
    "odict",
    "namespace",
    "dataclass",
    "object",
    "deque",
    "userlist",
    "userdict",
    "chainmap",
    "argns",
)
ROUTES = ("call", "hook", "prehook", "instance_forward", "global", "global_call")
CHANGES = ("none", "retarget", "swap_hook", "reassign", "fill", "retype", "slot")
TARGETS = ("module", "param")  # what the path leads to: a submodule, or a parameter of one

Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Box:
    k: Any


class Plain:
    """An object of the user's own class that holds a module, with a slot beside its
    ``__dict__`` (a scale applied to what it holds, when that is the module)."""

    __slots__ = ("__dict__", "scale")

    def __init__(self, k: Any) -> None:
        self.k = k
        self.scale = 1.0

    def get(self) -> Any:
        if self.scale == 1.0:
            return self.k
        return functools.partial(_times, self.k, self.scale)


class Twin(Plain):
    """What ``retype`` swaps a ``Plain``'s class to: it doubles what its module returns."""

    __slots__ = ()

    def get(self) -> Any:
        return functools.partial(_times, self.k, 2.0)


def _times(fn: Callable[[Any], Any], scale: float, y: Any) -> Any:
    return fn(y) * scale


def _ident(value: Any) -> Any:
    return value


def _closure(value: Any) -> Callable[[], Any]:
    return lambda: value


def reach(target: Any, y: torch.Tensor) -> torch.Tensor:
    """Use what a path led to: call a module (or a function), or write a parameter (a frozen
    tally, one more per forward) and scale by it."""
    if isinstance(target, torch.Tensor):  # (a replica's own: a tensor, as torch's are)
        with torch.no_grad():
            target.add_(1.0)
        return y * target
    out: torch.Tensor = target(y)
    return out


def wrap(kind: str, inner: Any) -> Any:
    """``inner`` held by a holder of ``kind``."""
    return {
        "list": lambda: [0, inner],
        "tuple": lambda: (0, inner),
        "dict": lambda: {"a": 0, "k": inner},
        "odict": lambda: OrderedDict(a=0, k=inner),
        "namedtuple": lambda: Pair(0, inner),
        "namespace": lambda: types.SimpleNamespace(k=inner),
        "dataclass": lambda: Box(inner),
        "object": lambda: Plain(inner),
        "closure": lambda: _closure(inner),
        "partial": lambda: functools.partial(_ident, inner),
        "deque": lambda: collections.deque([0, inner]),
        "userlist": lambda: collections.UserList([0, inner]),
        "userdict": lambda: collections.UserDict(a=0, k=inner),
        "chainmap": lambda: collections.ChainMap({"a": 0, "k": inner}),
        "argns": lambda: argparse.Namespace(k=inner),
    }[kind]()


def unwrap(kind: str, holder: Any) -> Any:
    """What a holder of ``kind`` holds (the way user code reads it)."""
    if kind in ("list", "tuple", "deque", "userlist"):
        return holder[1]
    if kind in ("dict", "odict", "userdict", "chainmap"):
        return holder["k"]
    if kind == "namedtuple":
        return holder.b
    if kind in ("closure", "partial"):
        return holder()
    if kind == "object":
        return holder.get()
    return holder.k


def retarget(kind: str, holder: Any, new: Any) -> None:
    """Point a mutable holder at ``new`` in place."""
    if kind in ("list", "deque", "userlist"):
        holder[1] = new
    elif kind in ("dict", "odict", "userdict", "chainmap"):
        holder["k"] = new
    else:
        holder.k = new


def follow(kinds: tuple[str, ...], path: Any) -> Any:
    for kind in reversed(kinds):  # the outermost holder was wrapped last
        path = unwrap(kind, path)
    return path


class Counter(nn.Module):
    """State a forward writes (a call count) and a parameter, so a run on the wrong module
    shows in the output, the gradients and the buffer."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), scale))
        self.tally = nn.Parameter(torch.full((4,), scale), requires_grad=False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.w + self.calls


GLOBAL_PATHS: dict[int, Any] = {}  # the module-level name a "global" route's hook reads


class Model(nn.Module):
    def __init__(
        self, kinds: tuple[str, ...], route: str, idle: bool = False, target: str = "module"
    ) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counter = Counter(0.5)
        self.other = Counter(-0.25)
        self.kinds, self.route, self.target = kinds, route, target
        self.key = id(self)  # the module-level entry of the "global" routes (replicas copy it)
        # ``idle``: the path leads nowhere (a plain function) until ``fill`` writes a module
        # of the tree into one of its holders, in place
        path: Any = _ident if idle else self.end(self.counter)
        self.holders: list[Any] = []  # innermost first, for a retarget
        for kind in kinds:
            path = wrap(kind, path)
            self.holders.append(path)
        self.handle: Any = None
        self.install(path)

    def end(self, counter: Counter) -> Any:
        """What a path leads to: ``counter``, or its tally."""
        return counter.tally if self.target == "param" else counter

    def install(self, path: Any) -> None:
        kinds, lin = self.kinds, self.lin
        if self.route == "call":
            self.path = path
        elif self.route == "hook":
            self.handle = lin.register_forward_hook(lambda m, i, o: reach(follow(kinds, path), o))
        elif self.route == "prehook":
            self.handle = lin.register_forward_pre_hook(
                lambda m, args: (reach(follow(kinds, path), args[0]),)
            )
        elif self.route == "instance_forward":
            orig = lin.forward
            lin.forward = types.MethodType(lambda s, x: reach(follow(kinds, path), orig(x)), lin)
        elif self.route == "global_call":  # the class's forward reads a module-level name
            GLOBAL_PATHS[self.key] = path
        else:  # "global": the hook reads a module-level name
            key = self.key
            GLOBAL_PATHS[key] = path
            self.handle = lin.register_forward_hook(
                lambda m, i, o: reach(follow(kinds, GLOBAL_PATHS[key]), o)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.route == "call":
            y = reach(follow(self.kinds, self.path), y)
        elif self.route == "global_call":
            y = reach(follow(self.kinds, GLOBAL_PATHS[self.key]), y)
        return y.tanh()


def change(model: Model, what: str) -> None:
    """The same change on the model and on its oracle (each its own objects)."""
    if what == "retarget":
        for i, (kind, holder) in enumerate(zip(model.kinds, model.holders, strict=True)):
            if kind in MUTABLE:  # the innermost mutable holder: a path to the other module
                inner: Any = model.end(model.other)
                for inner_kind in model.kinds[:i]:
                    inner = wrap(inner_kind, inner)
                retarget(kind, holder, inner)
                return
    elif what == "reassign":  # a new path of the same kinds, assigned where the old one was
        path: Any = model.end(model.other)
        for kind in model.kinds:
            path = wrap(kind, path)
        if model.route == "call":
            model.path = path
        elif model.route in ("global", "global_call"):
            GLOBAL_PATHS[model.key] = path
    elif what == "fill":  # the innermost mutable holder of an idle path: the counter
        for i, (kind, holder) in enumerate(zip(model.kinds, model.holders, strict=True)):
            if kind in MUTABLE:
                inner = model.end(model.counter)
                for inner_kind in model.kinds[:i]:
                    inner = wrap(inner_kind, inner)
                retarget(kind, holder, inner)
                return
    elif what in ("retype", "slot") and model.kinds[:1] == ("object",) and model.target == "module":
        innermost = model.holders[0]  # holds the counter itself
        if what == "retype":
            innermost.__class__ = Twin
        else:
            innermost.scale = 3.0
    elif what == "swap_hook" and model.handle is not None:
        model.handle.remove()
        model.kinds = ()
        model.install(model.end(model.other))  # an equivalent hook, to another module


def check(
    kinds: tuple[str, ...], route: str, what: str, devices: list[str], target: str = "module"
) -> None:
    # The oracle is built the same way, not deep-copied: a copy would share the hooks'
    # functions, and with them the paths to the model's own modules.
    torch.manual_seed(0)
    model = Model(kinds, route, idle=what == "fill", target=target)
    torch.manual_seed(0)
    oracle = Model(kinds, route, idle=what == "fill", target=target)
    wrapper = dp.DataParallel(model, devices)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 2 and what != "none":
            change(model, what)
            change(oracle, what)
        x = torch.randn(7, 4, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a serial run warns; the values are the test
            out = wrapper(x)
        want = oracle(x)
        where = f"{route} through {kinds} to a {target}, change {what}, call {step}"
        assert_close_rel(out, want, msg=f"{where}: output")
        out.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
            assert_close_rel(p, q, msg=f"{where}: parameter {name}")
            assert (p.grad is None) == (q.grad is None), f"{where}: grad of {name}"
            if p.grad is not None:
                assert_close_rel(p.grad, q.grad, msg=f"{where}: grad of {name}")
        for (name, b), c in zip(model.named_buffers(), oracle.buffers(), strict=True):
            assert_close_rel(b, c, msg=f"{where}: buffer {name}")
    GLOBAL_PATHS.pop(id(model), None)
    GLOBAL_PATHS.pop(id(oracle), None)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6).map(tuple),
    route=st.sampled_from(ROUTES),
    what=st.sampled_from(CHANGES),
    devices=st.sampled_from(DEVICE_LISTS),
    target=st.sampled_from(TARGETS),
)
def test_every_path_to_a_submodule_runs_on_its_replica(
    kinds: tuple[str, ...], route: str, what: str, devices: list[str], target: str
) -> None:
    check(kinds, route, what, devices, target)


# What the generator found, kept by name (the findings among them).
FOUND = [
    pytest.param(("odict",), "call", "none", id="ordered-dict-holder"),
    pytest.param(("namedtuple",), "call", "none", id="namedtuple-holder"),
    pytest.param(("namespace",), "call", "none", id="namespace-holder"),
    pytest.param(("dataclass",), "call", "none", id="dataclass-holder"),
    pytest.param(("list",) * 5, "call", "none", id="list-5-deep"),
    pytest.param(("object", "closure", "dict"), "hook", "none", id="object-closure-dict-hook"),
    pytest.param((), "instance_forward", "none", id="monkey-patched-forward"),
    pytest.param(("dict",), "global", "none", id="module-level-name-in-hook"),
    pytest.param(("object",), "global_call", "none", id="module-level-name-in-class-forward"),
    pytest.param(("list",), "call", "retarget", id="list-item-set-between-calls"),
    pytest.param(("dict",), "call", "retarget", id="dict-item-set-between-calls"),
    pytest.param(("tuple",), "hook", "swap_hook", id="hook-swapped-between-calls"),
    pytest.param(("partial",), "prehook", "swap_hook", id="pre-hook-swapped-between-calls"),
    # issue 50: holders that led nowhere, written in place after the first calls; a copied
    # holder's class swapped or slot written
    pytest.param(("list", "closure"), "hook", "fill", id="closure-list-filled-later"),
    pytest.param(("dict",), "call", "fill", id="dict-attribute-filled-later"),
    pytest.param(("object", "partial"), "prehook", "fill", id="object-filled-later"),
    pytest.param(("object",), "hook", "retype", id="holder-class-swapped"),
    pytest.param(("object", "dict"), "call", "slot", id="holder-slot-written"),
    # issue 60: standard-library containers filled after the first calls
    pytest.param(("deque", "closure"), "hook", "fill", id="closure-deque-filled-later"),
    pytest.param(("userlist",), "call", "fill", id="userlist-filled-later"),
    pytest.param(("userdict",), "call", "fill", id="userdict-filled-later"),
    pytest.param(("chainmap",), "prehook", "fill", id="chainmap-filled-later"),
    pytest.param(("argns",), "call", "fill", id="argparse-namespace-filled-later"),
]
# issue 60, M1: a path to a parameter of the tree, written through it in forward
FOUND_PARAMS = [
    pytest.param(("list",), "call", "none", id="param-in-a-list"),
    pytest.param(("tuple", "dict"), "hook", "none", id="param-in-a-dict-in-a-tuple-hook"),
    pytest.param(("closure",), "prehook", "none", id="param-in-a-closure-pre-hook"),
    pytest.param(("object", "partial"), "global", "none", id="param-through-a-global"),
    pytest.param(("dataclass",), "global_call", "none", id="param-global-in-class-forward"),
    pytest.param(("list",), "call", "retarget", id="param-list-item-set-between-calls"),
    pytest.param(("namedtuple",), "instance_forward", "none", id="param-instance-forward"),
    pytest.param(("deque",), "hook", "swap_hook", id="param-hook-swapped"),
    pytest.param(("userdict",), "call", "fill", id="param-filled-later"),
]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize(("kinds", "route", "what"), FOUND)
def test_found_paths(kinds: tuple[str, ...], route: str, what: str, devices: list[str]) -> None:
    check(kinds, route, what, devices)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize(("kinds", "route", "what"), FOUND_PARAMS)
def test_found_paths_to_a_parameter(
    kinds: tuple[str, ...], route: str, what: str, devices: list[str]
) -> None:
    check(kinds, route, what, devices, target="param")


class Ordered(nn.Module):
    """Submodules run in the order of a plain list and a dict of them (not ModuleList/Dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Counter(0.5), Counter(-1.5), Counter(2.0)
        self.order: list[nn.Module] = [self.a]
        self.route: dict[str, nn.Module] = {"first": self.a}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.order:
            x = m(x)
        return self.route["first"](x).tanh()


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("how", ["append", "item set", "slice assignment"])
def test_a_plain_list_or_dict_of_submodules_changed_in_place(how: str, devices: list[str]) -> None:
    torch.manual_seed(0)
    model, oracle = Ordered(), Ordered()
    oracle.load_state_dict(model.state_dict())
    wrapper = dp.DataParallel(model, devices)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        if step == 1:
            for m in (model, oracle):
                if how == "append":
                    m.order.append(m.c)
                elif how == "item set":
                    m.route["first"] = m.c
                else:
                    m.order[:] = [m.b]
        x = torch.randn(5, 4, generator=gen)
        assert_close_rel(wrapper(x), oracle(x), msg=f"{how}, call {step}")
        for (name, b), c in zip(model.named_buffers(), oracle.buffers(), strict=True):
            assert_close_rel(b, c, msg=f"{how}, call {step}: buffer {name}")
