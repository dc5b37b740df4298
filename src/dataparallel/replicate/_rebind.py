"""Rebind to a replica what is bound to a module of the tree.

A replica's ``__dict__`` is a copy of its source module's, so whatever the module holds that is
bound to itself would still be bound to the user's module on every replica, and run there from
every replica's thread: a ``forward`` replaced on the instance (``types.MethodType``,
accelerate's ``functools.partial(new_forward, module)``), hooks that are bound methods
(``self.lin.register_forward_hook(self._capture)``), state-dict hooks, methods kept in a tuple,
list or dict. BatchNorm then counts every chunk on the module, and a captured feature map is
whichever replica wrote last.

:func:`rebind` makes the replica's version of such a value: a bound method of a tree module
is bound to that module's replica; a ``functools.partial``, a closure (its cells and defaults)
and a tuple, list or dict that hold one are rebuilt around the rebound values (new cells only
where they held a tree module; the other cells stay shared). Containers are copied only when
they hold something rebound, so a list of numbers stays shared with the module, as any
mutable attribute is. The user's objects are never written.

What cannot be rebound (an object of the user's own class that holds the module, a value
nested deeper than :data:`MAX_DEPTH`) but still leads to a module of the tree, in a hook or an
instance ``forward``, is found by :func:`reaches`: the replica set then warns once and marks
its replicas (:data:`SERIAL`), and ``parallel_apply`` runs them one after another on the
calling thread, so that code never runs on the user's module from two threads at once.
"""

from __future__ import annotations

import functools
import gc
import types
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from dataparallel._common.warn import warn_user
from dataparallel.replicate._check import filled

__all__ = [
    "MAX_DEPTH",
    "REBOUND_TABLES",
    "SERIAL",
    "Rebinding",
    "bound_keys",
    "reaches",
    "rebind",
    "rebind_state",
    "replica_zero_grad",
]

# How deep a value is searched for something to rebind: a closure over a dict of methods is
# depth 2. Deeper values are left as they are (and announced by ``reaches`` if they lead back).
MAX_DEPTH = 4

# The key a replica's __dict__ holds when its set must run one replica at a time (the value
# says why); read by parallel_apply.
SERIAL = "_dataparallel_serial"

# The hook tables whose hooks are rebound (each replica gets its own copy of a table that holds
# one). Load-state-dict hooks are left: loading into a replica is not something forward does.
REBOUND_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
)

# __dict__ entries never searched: tables a fill replaces, or that hold no callables.
_SKIPPED = frozenset(
    ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *REBOUND_TABLES)
)
# The types a search looks into; anything else is left alone (most attributes are numbers,
# strings, tensors and tables).
_SEARCHED = (types.MethodType, types.FunctionType, functools.partial, tuple, list, dict)
_BINDABLE = frozenset((types.MethodType, types.FunctionType, functools.partial, tuple, list, dict))
_LOOKED_AT = (nn.Module, functools.partial)
# Types that never hold anything to rebind (most attributes): skipped by one set lookup.
_ATOMS = frozenset(
    (bool, int, float, complex, str, bytes, type(None), torch.Tensor, nn.Parameter, torch.dtype)
)

Mapping = dict[int, Any]  # id of a tree module -> what to bind in its place

# What the search binds in place of a tree module: anything that is no module of the tree.
_PROBE = object()
_KINDS = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "forward": "forward",
}


class Rebinding:
    """What one replica set rebinds, per module of the source tree (by preorder index).

    ``keys``: the ``__dict__`` entries of a module that hold something bound to the tree
    (searched at each refill of the module, applied to each replica's new ``__dict__``);
    ``serial``: the modules whose hooks or forward lead back to the tree through something
    that cannot be rebound, and which one (the replicas then run one at a time).
    """

    __slots__ = ("keys", "serial", "warned")

    def __init__(self) -> None:
        self.keys: dict[int, tuple[str, ...]] = {}
        self.serial: dict[int, tuple[str, Any]] = {}
        self.warned = False

    def plan(self, modules: list[nn.Module], indices: Any) -> None:
        """Search the modules at ``indices`` (just refilled) of the tree ``modules``."""
        probe = dict.fromkeys(map(id, modules), _PROBE)
        tree = set(probe)
        for i in indices:
            d = modules[i].__dict__
            keys = bound_keys(d, probe)
            if keys:
                self.keys[i] = keys
            else:
                self.keys.pop(i, None)
            found = _unbound(d, probe, tree)
            if found is None:
                self.serial.pop(i, None)
            else:
                self.serial[i] = found

    def mapping(self, modules: list[nn.Module], objects: list[nn.Module]) -> Mapping:
        """The mapping that binds each module of the tree to ``objects``, its replicas on one
        device (in the same preorder)."""
        return dict(zip(map(id, modules), objects, strict=True))

    def reason(self, modules: list[nn.Module], replicas: int) -> str | None:
        """Why the replicas of the tree ``modules`` must run one at a time (``None``: they
        need not); warns once per replica set."""
        if not self.serial:
            return None
        index, (table, hook) = min(self.serial.items())
        names = {id(m): n for n, m in modules[0].named_modules()}
        name = names.get(id(modules[index]), type(modules[index]).__name__)
        what = getattr(hook, "__qualname__", None) or type(hook).__name__
        where = f"module {name!r}" if name else "the module itself"
        reason = f"the {_KINDS[table]} {what} of {where}"
        if not self.warned and replicas > 1:
            self.warned = True
            warn_user(
                f"module: {reason} leads back to the module through an object that cannot be "
                f"rebound to each replica, so it would run on your module from every replica's "
                f"thread at once; the replicas of this module run one after another on the "
                f"calling thread instead. To run them in parallel, make it a method of the "
                f"module, or a function, closure or functools.partial over the module: those "
                f"are rebound to each replica"
            )
        return reason


def _unbound(d: dict[str, Any], probe: Mapping, tree: set[int]) -> tuple[str, Any] | None:
    """The first hook or instance ``forward`` of a module's ``__dict__`` ``d`` that still
    leads to the tree once rebound, as (table name, hook)."""
    forward = d.get("forward")
    if forward is not None and reaches(rebind(forward, probe), tree):
        return "forward", forward
    for name in REBOUND_TABLES:
        table = d.get(name)
        for hook in table.values() if table else ():
            if reaches(rebind(hook, probe), tree):
                return name, hook
    return None


def rebind(value: Any, mapping: Mapping) -> Any:
    """``value`` with every tree module in ``mapping`` (by id) replaced by its replica, where
    it is bound or held as described in the module docstring; ``value`` itself when nothing in
    it changes."""
    return _rebind(value, mapping, {}, 0)


def _rebind(value: Any, mapping: Mapping, memo: dict[int, Any], depth: int) -> Any:
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is types.MethodType:
        target = mapping.get(id(value.__self__))
        if target is not None:
            return types.MethodType(value.__func__, target)
        return value
    if isinstance(value, nn.Module):
        return mapping.get(id(value), value)
    if depth >= MAX_DEPTH or not _searched(value):
        return value
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = value  # a cycle back to this value keeps it as it is
    deeper = depth + 1
    result = value
    if kind is tuple or kind is list:
        if _ATOMS.issuperset(map(type, value)):  # kernel sizes, paddings: one C-level pass
            return value
        items = [_rebind(v, mapping, memo, deeper) for v in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            result = kind(items)
    elif kind is dict:
        new = {k: _rebind(v, mapping, memo, deeper) for k, v in value.items()}
        if any(new[k] is not v for k, v in value.items()):
            result = new
    elif isinstance(value, functools.partial):
        result = _rebind_partial(value, mapping, memo, deeper)
    elif kind is types.FunctionType:
        result = _rebind_function(value, mapping, memo, deeper)
    memo[key] = result
    return result


def _searched(value: Any) -> bool:
    return isinstance(value, _SEARCHED)


def _rebind_partial(
    value: functools.partial[Any], mapping: Mapping, memo: dict[int, Any], depth: int
) -> Any:
    func = _rebind(value.func, mapping, memo, depth)
    args = [_rebind(a, mapping, memo, depth) for a in value.args]
    keywords = {k: _rebind(v, mapping, memo, depth) for k, v in value.keywords.items()}
    extra = {k: _rebind(v, mapping, memo, depth) for k, v in value.__dict__.items()}
    if (
        func is value.func
        and all(a is b for a, b in zip(args, value.args, strict=True))
        and all(keywords[k] is v for k, v in value.keywords.items())
        and all(extra[k] is v for k, v in value.__dict__.items())
    ):
        return value
    new = type(value)(func, *args, **keywords)
    new.__dict__.update(extra)  # functools.update_wrapper's __wrapped__, __name__, ...
    return new


def _rebind_function(
    value: types.FunctionType, mapping: Mapping, memo: dict[int, Any], depth: int
) -> Any:
    cells = value.__closure__ or ()
    new_cells = list(cells)
    changed = False
    for i, cell in enumerate(cells):
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell (a name not assigned yet)
            continue
        rebound = _rebind(held, mapping, memo, depth)
        if rebound is not held:
            new_cells[i] = types.CellType(rebound)
            changed = True
    defaults = value.__defaults__
    if defaults:
        new_defaults = tuple(_rebind(d, mapping, memo, depth) for d in defaults)
        changed = changed or any(a is not b for a, b in zip(new_defaults, defaults, strict=True))
        defaults = new_defaults
    kwdefaults = value.__kwdefaults__
    if kwdefaults:
        new_kw = {k: _rebind(v, mapping, memo, depth) for k, v in kwdefaults.items()}
        changed = changed or any(new_kw[k] is not v for k, v in kwdefaults.items())
        kwdefaults = new_kw
    if not changed:
        return value
    fn = types.FunctionType(
        value.__code__, value.__globals__, value.__name__, defaults, tuple(new_cells)
    )
    fn.__kwdefaults__ = kwdefaults
    fn.__qualname__ = value.__qualname__
    fn.__doc__ = value.__doc__
    fn.__module__ = value.__module__
    fn.__dict__.update(value.__dict__)
    return fn


def bound_keys(d: dict[str, Any], probe: Mapping) -> tuple[str, ...]:
    """The entries of a module's ``__dict__`` (plain attributes, and the hook tables of
    :data:`REBOUND_TABLES`) that hold something :func:`rebind` changes, with ``probe`` any
    mapping of the tree's module ids. Searched once per module per refill; most modules
    have none."""
    found: list[str] = []
    for name, value in d.items():
        kind = type(value)
        if kind in _ATOMS or name in _SKIPPED:
            continue
        # Exact containers only: torch's own tables (OrderedDicts of flags) are not looked at.
        if kind not in _BINDABLE and not isinstance(value, _LOOKED_AT):
            continue
        if rebind(value, probe) is not value:
            found.append(name)
    for name in REBOUND_TABLES:
        table = d.get(name)
        if table and any(rebind(h, probe) is not h for h in table.values()):
            found.append(name)
    return tuple(found)


def rebind_state(d: dict[str, Any], keys: tuple[str, ...], mapping: Mapping) -> None:
    """Rebind the entries ``keys`` of a replica's new ``__dict__`` ``d`` to ``mapping``'s
    replicas; a hook table gets a new table of its own (the source's is never written)."""
    for name in keys:
        value = d[name]
        if name in REBOUND_TABLES:
            d[name] = OrderedDict((k, rebind(h, mapping)) for k, h in value.items())
        else:
            d[name] = rebind(value, mapping)


# Not followed when looking for a way back to the tree: leaves, and what lives as long as the
# program anyway (classes, modules).
_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.Tensor, type, types.ModuleType)


def reaches(value: Any, tree: set[int], limit: int = 5_000) -> bool:
    """Whether ``value`` (a rebound hook or forward) still leads to a module whose id is in
    ``tree``: through an object's attributes, a closure, a bound method, at any depth. Other
    modules (the replicas) are not looked into. A search past ``limit`` objects answers
    ``False``: the hook is then assumed not to touch the tree (a logger, a large registry)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, nn.Module):
            if id(obj) in tree:
                return True
            continue
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            return False
        if isinstance(obj, types.FunctionType):
            # Not __globals__: a module-level name for the model is not bound to this call.
            stack.extend(c.cell_contents for c in obj.__closure__ or () if filled(c))
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            stack.append(obj.__dict__)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
            stack.append(obj.__func__)
        else:
            stack.extend(gc.get_referents(obj))
    return False


def replica_zero_grad(set_to_none: bool = True) -> None:
    """A replica's ``zero_grad``: warns as torch's replicas do, and clears nothing.

    A replica lists its parameters (``self.parameters()``), which on the module's own device
    are the module's own: ``nn.Module.zero_grad`` would then clear the module's gradients from
    every replica's thread at once (a crash in torch's gradient setter), where one device
    clears them once. Replica 0, the module itself, still clears them, as on one device. Kept
    in each replica's ``__dict__`` as a plain function (no reference back to the replica).
    """
    warnings.warn(
        "Calling .zero_grad() from a module created with nn.DataParallel() has no effect on "
        "replicas: they share or copy the module's parameters; the module itself (replica 0) "
        "clears its gradients. Zero the gradients outside forward.",
        stacklevel=2,
    )
