"""What defines a module tree's structure, and whether its hooks refer back to it.

The replica cache keys a set of replicas on the structure they were built for: the submodules
(preorder, without repeats), their types, the names and identities of their children,
parameters and buffers, the storage of each parameter (a ``.to()`` moves it), each buffer's
shape, dtype and device, and the number of hooks. :func:`signature` computes it; the cache
compares it only after :mod:`dataparallel.mutations` says that some module changed.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

from dataparallel.guards import check_initialized

__all__ = ["Scripted", "fingerprint", "self_referencing", "signature"]


def fingerprint(root: nn.Module) -> tuple[list[nn.Module], list[Any]]:
    """The module tree (preorder, without repeats) and what defines its structure.

    Ids stand for objects: the replica set keeps every submodule and parameter alive, so an id
    cannot be reused while the set exists.
    """
    modules: list[nn.Module] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, torch.jit.ScriptModule):
            raise Scripted  # its tensors live in C++: torch's replicate handles it
        modules.append(module)
        children = module.__dict__["_modules"]
        stack.extend(c for c in reversed(children.values()) if c is not None)
    check_initialized(modules)
    return modules, signature(modules)


class Scripted(Exception):
    """A TorchScript module somewhere in the tree (raised by ``fingerprint``)."""


def signature(modules: list[nn.Module]) -> list[Any]:
    """What defines the structure of ``modules`` (a preorder walk): checked on every call.

    Taken over the cached preorder list, it equals the signature of a fresh walk whenever the
    structure is unchanged, and differs from the cached one whenever it changed: a replaced
    child shows in its parent's entry, which comes first in preorder.
    """
    sig: list[Any] = []
    add = sig.append
    for module in modules:
        d = module.__dict__
        get = d.get
        # Hook counts: a new hook re-runs the self-reference check of a rebuild.
        add(
            (
                type(module),
                len(get("_forward_hooks", ())),
                len(get("_forward_pre_hooks", ())),
                len(get("_backward_hooks", ())),
                len(get("_backward_pre_hooks", ())),
            )
        )
        # Empty groups add nothing (most modules are leaves or hold no tensors); the tags keep
        # the groups apart.
        children = d["_modules"]
        if children:
            add(("m", *children))
            add(tuple(map(id, children.values())))  # id(None) is no module's id
        params = d["_parameters"]
        if params:
            add(("p", *params))
            # A dtype or device change (``.to()``, which keeps the Parameter object) always
            # moves the data to a new allocation, so (id, data_ptr) catches it at a third of
            # the cost of reading shape, dtype and device; a shape change through ``.data``
            # needs no rebuild (same-device replicas share the Parameter, copies are checked).
            for p in params.values():
                add(None if p is None else (id(p), p.data_ptr()))
        buffers = d["_buffers"]
        if buffers:
            add(("b", *buffers))
            for b in buffers.values():
                add(None if b is None else (b.shape, b.dtype, b.device))
        add(0)  # end of this module
    return sig


def _mentions(obj: Any, root: nn.Module, depth: int = 3) -> bool:
    """Whether ``obj`` refers to ``root`` within a few hops (bound methods, closures, partials,
    containers). Used to keep self-referencing modules out of the side table."""
    if obj is root:
        return True
    if depth == 0 or isinstance(obj, (torch.Tensor, nn.Module, str, bytes, int, float, type)):
        return False
    if isinstance(obj, types.MethodType):
        return _mentions(obj.__self__, root, depth - 1)
    if isinstance(obj, functools.partial):
        items: list[Any] = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.FunctionType):
        items = [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        return False
    return any(_mentions(item, root, depth - 1) for item in items)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def self_referencing(modules: list[nn.Module]) -> bool:
    root = modules[0]
    for module in modules:
        for name, value in module.__dict__.items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            if _mentions(value, root):
                return True
    return False
