"""``dataparallel.replicate._check``: the module tree, its structure key, the snapshot and the
self-reference search, each checked on its own (the replica tests check them through
``replicate``).

Oracle: what each one is documented to tell apart. The structure key changes exactly when the
replicas must be built again (a child, parameter or buffer added, replaced or moved, a hook
added) and holds through writes a refill handles (attributes, training flags, tensor values).
The snapshot sees every write to the tree and names the modules written. The self-reference
search finds the root at any depth of what the modules' attributes hold, and only from the
modules it is told to start from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from dataparallel._common.stamps import AVAILABLE
from dataparallel.replicate import _check as check_module
from dataparallel.replicate._check import (
    Scripted,
    Snapshot,
    fingerprint,
    structure_key,
)
from dataparallel.replicate._reach import self_referencing


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.ReLU()))


def test_fingerprint_walks_the_tree_in_preorder_once_per_module() -> None:
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, nn.Tanh())
    root = nn.Sequential(inner, shared, nn.ReLU())
    modules, key = fingerprint(root)
    assert modules == [root, inner, shared, inner[1], root[2]]
    assert key == structure_key(modules)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_fingerprint_refuses_a_scripted_submodule() -> None:
    root = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Linear(2, 2)))
    with pytest.raises(Scripted):
        fingerprint(root)


def test_fingerprint_refuses_an_uninitialized_lazy_module() -> None:
    with pytest.raises(ValueError, match="uninitialized"):
        fingerprint(nn.Sequential(nn.LazyLinear(2)))


def _set_buffer(net: nn.Sequential) -> None:
    net[1].running_mean = torch.zeros(5)  # another shape


def _move_data(net: nn.Sequential) -> None:
    net[0].weight.data = net[0].weight.data.clone()  # same Parameter, new storage


REBUILDS: dict[str, Callable[[nn.Sequential], Any]] = {
    "child added": lambda n: n.append(nn.Tanh()),
    "child replaced by one of the same type": lambda n: n.__setitem__(2, nn.Sequential(nn.ReLU())),
    "parameter replaced": lambda n: n[0].register_parameter("bias", nn.Parameter(torch.zeros(4))),
    "parameter set to None": lambda n: setattr(n[0], "bias", None),
    "buffer of another shape": _set_buffer,
    "parameter data moved": _move_data,
    "forward hook added": lambda n: n[2].register_forward_hook(lambda *a: None),
    "forward pre-hook added": lambda n: n[0].register_forward_pre_hook(lambda *a: None),
}


@pytest.mark.parametrize("change", sorted(REBUILDS))
def test_the_structure_key_changes_when_the_replicas_must_be_rebuilt(change: str) -> None:
    net = _net()
    modules, key = fingerprint(net)
    REBUILDS[change](net)
    # The cached preorder list, as a replica set checks it on every call.
    assert structure_key(modules) != key


REFILLS: dict[str, Callable[[nn.Sequential], Any]] = {
    "attribute written": lambda n: setattr(n[2][0], "inplace", True),
    "new attribute": lambda n: setattr(n, "scale", 3.0),
    "eval()": lambda n: n.eval(),
    "values updated in place": lambda n: n[0].weight.data.add_(1.0),
    "buffer replaced by one of the same shape": lambda n: setattr(
        n[1], "running_var", torch.full((4,), 2.0)
    ),
}


@pytest.mark.parametrize("change", sorted(REFILLS))
def test_the_structure_key_holds_through_what_a_refill_handles(change: str) -> None:
    net = _net()
    modules, key = fingerprint(net)
    REFILLS[change](net)
    assert structure_key(modules) == key
    assert fingerprint(net)[1] == key  # and a fresh walk agrees


# Preorder indices of _net(): 0 the root, 1 Linear, 2 BatchNorm1d, 3 Sequential, 4 ReLU.
SNAPSHOT_WRITES: dict[str, tuple[Callable[[nn.Sequential], Any], list[int]]] = {
    "attribute on the root": (lambda n: setattr(n, "scale", 2.0), [0]),
    "training flag of one child": (lambda n: n[1].eval(), [2]),
    "past torch's methods": (
        lambda n: n[0]._parameters.__setitem__("weight", nn.Parameter(torch.ones(4, 3))),
        [1],
    ),
    "__dict__ directly": (lambda n: n[2][0].__dict__.__setitem__("inplace", True), [4]),
    "parameter data moved": (_move_data, [1]),
    "hook on a leaf": (lambda n: n[2][0].register_forward_hook(lambda *a: None), [4]),
    "child removed": (lambda n: n[2].__delitem__(0), [3]),
    "two modules": (lambda n: (setattr(n[0], "tag", 1), setattr(n[2], "training", False)), [1, 3]),
}


@pytest.fixture(params=["stamped", "compared"])
def stamping(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The snapshot with the interpreter's write stamps (where it has them), and without:
    every identity compared on every call, as on an interpreter without them."""
    if request.param == "compared":
        monkeypatch.setattr(check_module, "make_stamps", lambda dicts, **_: None)
    return request.param == "stamped"


@pytest.mark.parametrize("write", sorted(SNAPSHOT_WRITES))
def test_the_snapshot_sees_a_write_and_names_the_modules(write: str, stamping: bool) -> None:
    net = _net()
    snapshot = Snapshot(list(net.modules()))
    assert snapshot.same() and snapshot.changed() == []
    act, written = SNAPSHOT_WRITES[write]
    act(net)
    assert not snapshot.same()
    assert snapshot.changed() == written


def test_values_updated_in_place_leave_the_snapshot_holding(stamping: bool) -> None:
    net = _net()
    snapshot = Snapshot(list(net.modules()))
    with torch.no_grad():
        net[0].weight.mul_(2.0)
        net[1].running_mean.add_(1.0)
    assert snapshot.same()
    assert (snapshot._stamps is not None) == (stamping and AVAILABLE)


def test_hooks_reordered_in_place_are_seen(stamping: bool) -> None:
    """A hook table's order lives outside its dictionary (``move_to_end`` moves no stamp): the
    tables that are not plain dictionaries are compared on every call."""
    net = _net()
    first = net[0].register_forward_hook(lambda *a: None)
    net[0].register_forward_hook(lambda *a: None)
    snapshot = Snapshot(list(net.modules()))
    net[0]._forward_hooks.move_to_end(first.id)
    assert not snapshot.same() and snapshot.changed() == [1]


def test_a_write_undone_leaves_the_snapshot_holding(stamping: bool) -> None:
    """A table written back to what it held moves its stamp but not the tree: the full
    comparison answers, and the stamps are taken again."""
    net = _net()
    snapshot = Snapshot(list(net.modules()))
    params = net[0]._parameters
    weight = params["weight"]
    params["weight"] = nn.Parameter(torch.ones(4, 3))
    params["weight"] = weight
    assert snapshot.same() and snapshot.same()
    net[0].tag = 1
    assert not snapshot.same()


def test_retake_brings_the_snapshot_in_line_with_the_written_modules(stamping: bool) -> None:
    net = _net()
    modules = list(net.modules())
    snapshot = Snapshot(modules)
    net[0].tag = "a"
    net[2][0].tag = "b"
    assert snapshot.changed() == [1, 4]
    snapshot.retake(modules, [1])
    assert not snapshot.same() and snapshot.changed() == [4]
    snapshot.retake(modules, [4])
    assert snapshot.same()


class _Holder:
    def __init__(self, held: object) -> None:
        self.held = {"deep": [held]}


def test_self_referencing_finds_the_root_at_any_depth() -> None:
    net = _net()
    assert not self_referencing(list(net.modules()))
    net[2][0].config = _Holder(net)  # a config object holding the model, two levels down
    assert self_referencing(list(net.modules()))


def test_self_referencing_follows_hooks_and_closures() -> None:
    net = _net()
    net.register_forward_hook(net.__class__.forward.__get__(net))  # a bound method of the root
    assert self_referencing(list(net.modules()))
    other = _net()

    def hook(*args: object) -> None:
        other.train()  # a closure over the root

    other[0].register_forward_pre_hook(hook)
    assert self_referencing(list(other.modules()))


def test_self_referencing_ignores_globals_and_other_modules_of_the_tree() -> None:
    net = _net()
    object.__setattr__(net[1], "sibling", net[0])  # another module of the tree, not the root
    net[0].fn = _net  # a module-level function: its globals are not followed
    assert not self_referencing(list(net.modules()))


def test_self_referencing_starts_only_from_the_modules_written() -> None:
    net = _net()
    net[2][0].owner = _Holder(net)
    modules = list(net.modules())
    assert modules[4] is net[2][0]
    assert not self_referencing(modules, written=[0, 1])
    assert self_referencing(modules, written=[4])


def test_self_referencing_gives_up_past_its_limit_as_yes() -> None:
    net = _net()
    net.big = [[object()] for _ in range(50)]
    modules = list(net.modules())
    assert not self_referencing(modules)
    assert self_referencing(modules, limit=10)


def test_self_referencing_follows_tensor_hooks_and_attributes() -> None:
    # A parameter's hook or attribute that leads back (issue 29, item 12: the replica table
    # kept such modules, and their replicas, alive for ever).
    hooked = nn.Sequential(nn.Linear(2, 2))
    hooked.scale = 2.0
    hooked[0].weight.register_hook(lambda g: g * hooked.scale)
    assert self_referencing(fingerprint(hooked)[0])
    owned = nn.Sequential(nn.Linear(2, 2))
    owned[0].bias.owner = owned  # type: ignore[attr-defined]
    assert self_referencing(fingerprint(owned)[0])
    plain = nn.Sequential(nn.Linear(2, 2))
    plain[0].weight.register_hook(lambda g: g * 2)
    assert not self_referencing(fingerprint(plain)[0])


@pytest.mark.skipif(not AVAILABLE, reason="this interpreter keeps no readable dict tags")
def test_stamps_are_made_once_and_kept_through_refills() -> None:
    """A snapshot makes its stamps at its first full comparison that finds the tree unchanged
    (a replica set built for one call never pays for them) and keeps them through retakes that
    leave every table the same object; a table replaced makes them again."""
    net = _net()
    modules = list(net.modules())
    snapshot = Snapshot(modules)
    assert snapshot._stamps is None
    assert snapshot.same()
    made = snapshot._stamps
    assert made is not None
    net[0].tag = 1
    assert not snapshot.same()
    snapshot.retake(modules, snapshot.changed())
    assert snapshot._stamps is made and snapshot.same()
    net[2][0]._forward_hooks = type(net[2][0]._forward_hooks)()  # a new table object
    assert not snapshot.same()
    snapshot.retake(modules, snapshot.changed())
    assert snapshot._stamps is None
    assert snapshot.same() and snapshot._stamps is not None and snapshot.same()


@pytest.mark.parametrize("where", [0, 1, 4])  # the root, a child, a grandchild
@pytest.mark.parametrize("write", ["class", "dict", "dict of the same contents"])
def test_a_class_or_dictionary_replaced_is_seen_past_the_stamps(
    stamping: bool, where: int, write: str
) -> None:
    """``module.__class__ = Other`` and ``module.__dict__ = {...}`` write no table, so no
    stamp moves: the class and the dictionary object are compared on every call, for the
    root as for every other module (a dictionary with the same contents included)."""
    net = _net()
    modules = list(net.modules())
    snapshot = Snapshot(modules)
    assert snapshot.same() and snapshot.same()  # (the stamps are taken where there are some)
    target = modules[where]
    if write == "class":
        target.__class__ = type(f"Other{type(target).__name__}", (type(target),), {})
    elif write == "dict":
        target.__dict__ = {**target.__dict__, "tag": 1}
    else:
        target.__dict__ = dict(target.__dict__)
    assert not snapshot.same()
