"""A replica of a module with a replication of its own: a class that overrides
``_replicate_for_data_parallel`` or ``__setattr__`` (``nn.RNN``, whose flat weights follow
its parameters). Its dictionary is made by that hook at each sync of new tensors, and its
parameters are set through ``setattr``, so the class's own code sees them; the rest is as for
any replica (its own hook tables, the tree rebound to it, the root's marks kept). Apart from
``_replicas``, which fills the plain modules' dictionaries itself.

And the other state a replica holds outside its dictionary: a slotted class's slot values
(``copy_slots``), copied on every sync.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn

from dataparallel.replicate._rebind import SERIAL, rebind_state
from dataparallel.replicate._records import Node, ParameterTable, Replica, buffer_table
from dataparallel.replicate._written import WRITES

if TYPE_CHECKING:
    from dataparallel.replicate._replicas import Replicas

__all__ = ["copy_slots", "sync_custom"]


def sync_custom(
    root: nn.Module,
    replica: Replica,
    node: Node,
    tensors: list[torch.Tensor],
    buffers: list[torch.Tensor],
    owner: Replicas,
) -> None:
    """Re-sync ``node``, a replica (of ``owner``'s set) of a module with its own replication
    hook or ``__setattr__``, with this sync's ``tensors`` and ``buffers``."""
    s = node.source
    src = root if s.module is None else s.module
    d = src._replicate_for_data_parallel().__dict__.copy()
    none_params = s.none_params
    d["_parameters"] = dict.fromkeys(none_params) if none_params else {}
    d["_modules"] = node.children.copy()
    d["_is_replica"] = True
    d["_buffers"] = buffer_table(s, buffers)
    attrs: OrderedDict[str, torch.Tensor] = OrderedDict(
        zip(s.param_names, map(tensors.__getitem__, s.param_slots), strict=True)
    )
    d["_former_parameters"] = attrs
    owner.own_state(d, node.hooks, src)
    rebinding = owner.rebinding
    keys = rebinding.keys.get(s.index)
    if keys:
        modules = owner.modules(root)
        objects = [n.module for n in replica.nodes]
        rebind_state(d, keys, rebinding.mapping(modules, objects), node.module)
    rep = node.module
    for mark in (SERIAL, WRITES):  # the root's marks, set by the last fill
        if mark in rep.__dict__:
            d[mark] = rep.__dict__[mark]
    object.__setattr__(rep, "__dict__", d)
    if attrs:
        for name, value in attrs.items():
            setattr(rep, name, value)  # e.g. RNN refreshes its flat weights
        # setattr registers a same-device Parameter (and a copy lands in ``__dict__``):
        # make both hold every tensor, as ``_install`` does for plain modules.
        rep.__dict__.update(attrs)
        table = ParameterTable(rep, dict.fromkeys(none_params))
        dict.update(table, attrs)
        rep.__dict__["_parameters"] = table


def copy_slots(
    modules: list[nn.Module], slotted: list[tuple[int, tuple[str, ...]]], replicas: list[Replica]
) -> None:
    """Each slotted module's slot values (``slotted``: its preorder index and slot names), as
    they are now, on its replicas in ``replicas`` (an unset slot unset there too)."""
    for i, names in slotted:
        source = modules[i]
        for replica in replicas:
            target = replica.nodes[i].module
            for name in names:
                try:
                    object.__setattr__(target, name, object.__getattribute__(source, name))
                except AttributeError:  # unset on the module: unset on the replica
                    with contextlib.suppress(AttributeError):
                        object.__delattr__(target, name)
