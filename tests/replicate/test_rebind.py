"""Methods and hooks bound to a module of the tree run bound to the replica (issue 29, item 3).

A ``forward`` replaced on the instance (``types.MethodType``, accelerate's
``functools.partial(new_forward, module)``), hooks that are bound methods of the module, and
such methods kept in a partial, a closure or a container ran on the user's module from every
replica thread: BatchNorm counted every chunk (``num_batches_tracked`` 6 on two devices where
one device gives 3) and a captured feature map was sometimes replica 1's rows. Oracle: the same
module run plainly on one device. What cannot be rebound (an object holding the module) is
announced once and the replicas then run one after another on the calling thread.
"""

from __future__ import annotations

import copy
import functools
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
IDS = ["shared", "copied", "mixed"]
CALLS = 3


class Normed(nn.Module):
    """Linear then BatchNorm: ``num_batches_tracked`` counts the calls that reached the
    module's own BatchNorm (one per call on one device)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))

    def scaled(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.bn(self.lin(x)) * scale


def _new_forward(self: Normed, x: torch.Tensor) -> torch.Tensor:
    return self.bn(self.lin(x)) * 2.0


def _method_type(m: Normed) -> None:
    m.forward = types.MethodType(_new_forward, m)  # type: ignore[method-assign]


def _accelerate(m: Normed) -> None:
    # accelerate's add_hook_to_module: the old bound forward kept on the module, the new
    # forward a partial over the module.
    def new_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return module._old_forward(*args, **kwargs) * 2.0

    old_forward = m.bn.forward
    m.bn._old_forward = old_forward
    m.bn.forward = functools.update_wrapper(functools.partial(new_forward, m.bn), old_forward)


def _closure(m: Normed) -> None:
    inner = m.forward  # a bound method captured by a closure

    def forward(x: torch.Tensor) -> torch.Tensor:
        return inner(x) * 2.0

    m.forward = forward  # type: ignore[method-assign]


def _partial_of_method(m: Normed) -> None:
    m.forward = functools.partial(m.scaled, scale=2.0)  # type: ignore[method-assign]


class _Steps(Normed):
    def __init__(self, kind: str) -> None:
        super().__init__()
        steps: Any = [self._first, self._second]
        self.steps = tuple(steps) if kind == "tuple" else steps
        self.by_name = {"first": self._first}

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def _second(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) * 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.steps[1](self.by_name["first"](x))


REWRITES: dict[str, Callable[[], nn.Module]] = {
    "MethodType forward": lambda: _rewritten(_method_type),
    "accelerate partial": lambda: _rewritten(_accelerate),
    "closure over a bound method": lambda: _rewritten(_closure),
    "partial of a bound method": lambda: _rewritten(_partial_of_method),
    "methods in a list and a dict": lambda: _Steps("list"),
    "methods in a tuple": lambda: _Steps("tuple"),
}


def _rewritten(rewrite: Callable[[Normed], None]) -> Normed:
    m = Normed()
    rewrite(m)
    return m


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(REWRITES))
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_rewritten_forward_runs_on_each_replica(kind: str, devices: list[str]) -> None:
    torch.manual_seed(0)
    model = REWRITES[kind]()
    torch.manual_seed(0)
    oracle = REWRITES[kind]()  # built alike (deepcopy would share a closure with the model)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    for _ in range(CALLS):
        wrapper(x).pow(2).sum().backward()
        oracle(x).pow(2).sum().backward()
    bn, ref = model.get_submodule("bn"), oracle.get_submodule("bn")
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == CALLS
    # Eval, from the same state (training statistics came from replica 0's chunk, as in
    # torch): BatchNorm's running statistics, so the outputs and gradients are one device's.
    oracle.load_state_dict(model.state_dict())
    model.eval()
    oracle.eval()
    model.zero_grad()
    oracle.zero_grad()
    out, ref = wrapper(x), oracle(x)
    assert_close_rel(out, ref, msg="output")
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    mine, theirs = _grads(model), _grads(oracle)
    assert mine.keys() == theirs.keys() == dict(model.named_parameters()).keys()
    for name in mine:
        assert_close_rel(mine[name], theirs[name], msg=name)


@pytest.mark.parametrize("kind", list(REWRITES))
def test_a_rewritten_forward_is_bound_to_the_replica_itself(kind: str) -> None:
    model = REWRITES[kind]()
    replicas = dp.replicate(model, ["cpu", "cpu:1"])
    before = int(model.bn.num_batches_tracked)  # type: ignore[arg-type]
    replicas[1](torch.randn(3, 4))
    # Replica 1 ran its own BatchNorm (its private statistics), not the module's.
    assert int(replicas[1].bn.num_batches_tracked) == before + 1  # type: ignore[arg-type]
    assert int(model.bn.num_batches_tracked) == before  # type: ignore[arg-type]


class Captures(nn.Module):
    """Hooks of every kind that are bound methods of the root."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)
        self.feature: torch.Tensor | None = None
        self.pre_seen: list[nn.Module] = []
        self.backward_calls = 0
        self.lin.register_forward_hook(self._capture)
        self.out.register_forward_pre_hook(self._pre, with_kwargs=True)
        self.out.register_full_backward_hook(self._backward)
        self._register_state_dict_hook(self._state_hook)
        self.state_owner: list[bool] = []

    def _capture(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.feature = output

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.pre_seen = [*self.pre_seen, self]  # a new list: a replica's write stays its own

    def _backward(self, module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        self.backward_calls += 1

    def _state_hook(self, module: nn.Module, state: Any, prefix: str, meta: Any) -> None:
        self.state_owner = [*self.state_owner, module is self]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state_dict()
        return self.out(torch.relu(self.lin(x)))


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_hooks_bound_to_the_module_run_bound_to_each_replica(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Captures()
    oracle = copy.deepcopy(model)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4, requires_grad=True)
    rows = -(-7 // len(devices))  # replica 0's chunk: the larger first
    for _ in range(20):  # the capture is replica 0's rows every time, never another's
        model.backward_calls = oracle.backward_calls = 0
        wrapper(x).sum().backward()
        oracle(x).sum().backward()
        assert model.feature is not None
        assert_close_rel(model.feature, oracle.feature[:rows], msg="feature")  # type: ignore[index]
        assert model.backward_calls == oracle.backward_calls == 1
    # What the module's own hooks saw: itself, once per call (replica 0 is the module).
    assert all(s is model for s in model.pre_seen) and len(model.pre_seen) == 20
    assert model.state_owner == [True] * 20 == oracle.state_owner


def test_each_replica_runs_its_hooks_bound_to_itself() -> None:
    model = Captures()
    replicas = dp.replicate(model, ["cpu", "cpu:1", "cpu:1"])
    for r in replicas[1:]:
        r(torch.randn(2, 4))
        assert r.feature is not None and r.feature.shape == (2, 3)
        assert r.pre_seen == [r]
        assert r.state_owner == [True]
    assert model.feature is None and model.pre_seen == [] and model.state_owner == []


class Holder:
    """An object holding the module that a copy cannot rebuild (slots, no ``__dict__``): its
    ``__call__`` cannot be rebound to a replica."""

    __slots__ = ("module", "threads")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.threads: list[int] = []

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.threads.append(threading.get_ident())
        self.module.feature = output  # type: ignore[union-attr]


class OwnHolder:
    """The same holder as an ordinary object of the user's own class (a ``__dict__``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.threads: list[int] = []

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.threads.append(threading.get_ident())
        self.module.feature = output  # type: ignore[union-attr]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_an_object_of_the_users_own_holding_the_module_is_rebuilt_per_replica(
    devices: list[str],
) -> None:
    """Each replica's hook is a copy of the holder pointing at that replica: the replicas run
    in parallel, with no serial warning, and the module keeps replica 0's feature (its
    chunk's). The copies share the holder's ``threads`` list, which each replica's hook
    appends to: that write, one per replica, is said once (``Rebinding.said_written``)."""
    torch.manual_seed(0)
    model = Captures()
    holder = OwnHolder(model)
    model.lin.register_forward_hook(holder)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrapper(x)
        wrapper(x)
    said = [str(w.message) for w in seen]
    assert len(said) == 1 and "a list the" in said[0] and "forward wrote" in said[0], said
    holder.threads.clear()
    wrapper(x)
    feature, runs = model.feature, len(holder.threads)
    assert holder.module is model  # the user's holder is left as it was
    assert runs == len(devices)  # the copies share the holder's list
    first = -(-7 // len(devices))  # replica 0's chunk
    assert feature is not None
    with torch.no_grad():
        assert_close_rel(feature.detach(), model.lin(x[:first]), msg="replica 0's feature")


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_hook_that_cannot_be_rebound_is_announced_and_never_run_concurrently(
    devices: list[str],
) -> None:
    torch.manual_seed(0)
    model = Captures()
    holder = Holder(model)
    model.lin.register_forward_hook(holder)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    with pytest.warns(UserWarning, match=r"forward hook .*Holder.* of module 'lin'.*one after"):
        wrapper(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper(x)  # once per replica set
    # Every replica ran on the calling thread, one after another.
    assert set(holder.threads) == {threading.get_ident()}
    assert len(holder.threads) == 2 * len(devices)


def test_rebinding_leaves_the_users_objects_alone() -> None:
    model = _Steps("list")
    steps, by_name = model.steps, model.by_name
    _method_type(model)
    forward = model.forward
    replicas = dp.replicate(model, ["cpu", "cpu:1"])
    replicas[1](torch.randn(2, 4))
    assert model.steps is steps and [s.__self__ for s in steps] == [model, model]
    assert model.by_name is by_name and by_name["first"].__self__ is model
    assert model.forward is forward and forward.__self__ is model
    assert replicas[1].steps[0].__self__ is replicas[1]
    assert replicas[1].forward.__self__ is replicas[1]


class Tapped(nn.Module):
    """A feature capture on ``lin`` registered in one of the forms users write."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)
        self.feature: torch.Tensor | None = None
        if form == "partial of a bound method":
            self.lin.register_forward_hook(functools.partial(self._tap, name="lin"))
        elif form == "closure over the module":
            self.lin.register_forward_hook(lambda m, i, o: setattr(self, "feature", o))
        elif form == "with_kwargs and always_call":
            self.lin.register_forward_hook(self._tap_kwargs, with_kwargs=True, always_call=True)
        elif form == "partial over the module":
            self.lin.register_forward_hook(functools.partial(_tap_function, self))
        elif form == "default argument":
            self.lin.register_forward_hook(lambda m, i, o, owner=self: owner._tap(m, i, o))

    def _tap(self, module: nn.Module, args: Any, output: torch.Tensor, name: str = "") -> None:
        self.feature = output

    def _tap_kwargs(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.feature = output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x))


def _tap_function(owner: Tapped, module: nn.Module, args: Any, output: torch.Tensor) -> None:
    owner.feature = output


FORMS = [
    "partial of a bound method",
    "closure over the module",
    "with_kwargs and always_call",
    "partial over the module",
    "default argument",
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_capture_in_any_form_is_replica_zeros_rows_every_time(
    form: str, devices: list[str]
) -> None:
    torch.manual_seed(0)
    model = Tapped(form)
    torch.manual_seed(0)
    oracle = Tapped(form)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    rows = -(-7 // len(devices))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every form is rebound: nothing to announce
        for _ in range(10):
            model.feature = None
            assert_close_rel(wrapper(x), oracle(x), msg="output")
            assert model.feature is not None
            assert_close_rel(model.feature, oracle.feature[:rows], msg="feature")  # type: ignore[index]
    replicas = dp.replicate(model, devices)
    model.feature = None
    replicas[-1](x[:2])
    assert model.feature is None
    assert replicas[-1].feature is not None and replicas[-1].feature.shape == (2, 3)


class Recurrent(nn.Module):
    """An LSTM (a module with its own replication hook) whose output a bound method captures."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 3, batch_first=True)
        self.feature: torch.Tensor | None = None
        self.rnn.register_forward_hook(self._capture)

    def _capture(self, module: nn.Module, args: Any, output: Any) -> None:
        self.feature = output[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_hooks_on_a_module_with_its_own_replication_are_rebound(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Recurrent()
    torch.manual_seed(0)
    oracle = Recurrent()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 2, 4)
    rows = -(-7 // len(devices))
    for _ in range(5):
        assert_close_rel(wrapper(x), oracle(x), msg="output")
        assert_close_rel(model.feature, oracle.feature[:rows], msg="feature")  # type: ignore[arg-type, index]
    replicas = dp.replicate(model, devices)
    model.feature = None
    replicas[-1](x[:2])
    assert model.feature is None and replicas[-1].feature is not None


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_a_root_with_its_own_replication_keeps_the_one_at_a_time_mark(devices: list[str]) -> None:
    # The root's replicas get a new __dict__ on every call where their tensors change: the
    # mark that makes them run one at a time must survive it.
    torch.manual_seed(0)
    model = nn.LSTM(4, 3, batch_first=True)
    holder = Holder(model)
    model.register_forward_hook(holder)
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 2, 4)
    with pytest.warns(UserWarning, match=r"forward hook Holder of the module itself"):
        wrapper(x)
    for _ in range(3):
        wrapper(x)[0].sum().backward()
    assert set(holder.threads) == {threading.get_ident()}
    assert len(holder.threads) == 4 * len(devices)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
def test_accelerates_own_module_hooks_run_on_each_replica(devices: list[str]) -> None:
    hooks = pytest.importorskip("accelerate.hooks")

    class Double(hooks.ModelHook):  # type: ignore[misc, name-defined]
        def post_forward(self, module: nn.Module, output: Any) -> Any:
            return output * 2.0

    def build() -> Normed:
        torch.manual_seed(0)
        m = Normed()
        hooks.add_hook_to_module(m.bn, Double())
        return m

    model, oracle = build(), build()
    wrapper = dp.DataParallel(model, devices)
    x = torch.randn(7, 4)
    for _ in range(CALLS):
        wrapper(x).sum().backward()
        oracle(x).sum().backward()
    assert int(model.bn.num_batches_tracked) == int(oracle.bn.num_batches_tracked) == CALLS
    oracle.load_state_dict(model.state_dict())
    model.eval()
    oracle.eval()
    assert_close_rel(wrapper(x), oracle(x), msg="output")


class _SerialModel(nn.Module):
    """A model whose ``lin`` has a hook that cannot be rebound, and the wrapper layers that
    wrap replicas before they run: SyncBatchNorm, a step method."""

    def __init__(self, syncbn: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.SyncBatchNorm(4) if syncbn else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))

    def train_step(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self(x).sum()}


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=IDS)
@pytest.mark.parametrize("layer", ["syncbn", "train_step", "compile"])
def test_the_one_at_a_time_mark_holds_under_every_wrapper_layer(
    layer: str, devices: list[str]
) -> None:
    model = _SerialModel(syncbn=layer == "syncbn")
    holder = Holder(model)
    model.lin.register_forward_hook(holder)
    options = {"compile": {"backend": "eager"}} if layer == "compile" else {}
    wrapper = dp.DataParallel(model, devices, **options)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-at-a-time warning (tested above)
        for _ in range(2):
            x = torch.randn(6, 4)
            wrapper.train_step(x) if layer == "train_step" else wrapper(x)
    assert set(holder.threads) == {threading.get_ident()}, "a replica ran on a pool thread"
    assert len(holder.threads) == 2 * len(devices)


class KeyProxy:
    """A proxy whose ``__getattr__`` raises ``KeyError`` for a name it does not hold (not
    ``AttributeError``), leading to a module of the tree."""

    def __init__(self, names: dict[str, nn.Module]) -> None:
        self.__dict__["_names"] = names

    def __getattr__(self, name: str) -> Any:
        return self._names[name]


class ThroughProxy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.proxy = KeyProxy({"layer": self.lin})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proxy.layer(x)


def test_a_proxy_whose_getattr_raises_key_error_is_named_in_the_warning() -> None:
    """The serial warning names the object by its class: asking a proxy for ``__qualname__``
    raised its own ``KeyError`` out of the call (found by the holders' probe of stop 74)."""
    torch.manual_seed(0)
    model = ThroughProxy()
    x = torch.randn(7, 4)
    with pytest.warns(UserWarning, match="'proxy', KeyProxy of the module itself"):
        out = dp.DataParallel(model, ["cpu", "cpu"])(x)
    with torch.no_grad():
        assert_close_rel(out.detach(), model(x), msg="output")


class ThreadScaled(nn.Module):
    """Reads a scale from a ``threading.local`` the caller's thread set."""

    def __init__(self, default: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.local = threading.local()
        self.local.scale = 2.0
        self.default = default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = getattr(self.local, "scale", 1.0) if self.default else self.local.scale
        return self.lin(x) * scale


@pytest.mark.parametrize("default", [True, False], ids=["read with a default", "read bare"])
def test_a_threading_local_on_the_module_runs_the_replicas_on_the_calling_thread(
    default: bool,
) -> None:
    """A replica on a worker thread saw none of what the caller's thread set: with a default,
    its rows silently used it (off by up to 1.39); without one, an ``AttributeError`` (stop
    74's holders probe). The replicas now run on the calling thread, said once."""
    model = ThreadScaled(default)
    x = torch.randn(8, 4)
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    with torch.no_grad():
        with pytest.warns(UserWarning, match="'local', _local of the module itself holds a threa"):
            got = wrapper(x)
        assert_close_rel(got, model(x), msg="output")
        assert_close_rel(wrapper(x), model(x), msg="output, second call")
