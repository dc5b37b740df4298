"""Whether what the replicas keep of a module tree leads back to its root.

The process-wide replica table holds a root only weakly; state that reached it strongly (a
hook that is a bound method, a helper holding the model, a closure over it) would keep it
alive for ever. :func:`self_referencing` walks what the replicas keep, at any depth, with a
limit; :func:`filled` tells whether a closure cell holds a value (read by the searches that
follow closures).
"""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["filled", "self_referencing"]


# Objects whose references are not followed when looking for a way back to the root: leaves,
# and what lives as long as the program anyway (classes, modules, a function's globals).
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)


def _referents(obj: Any) -> Iterator[Any]:
    if isinstance(obj, torch.Tensor):
        # Not its data: what Python code hangs on it (``weight.register_hook(lambda g: g *
        # self.gscale)``, ``weight.owner = self``) can lead back to the module.
        yield from _tensor_referents(obj)
    elif isinstance(obj, types.FunctionType):
        # Not __globals__: a module-level name for the model is not a cycle through it.
        yield from (cell.cell_contents for cell in obj.__closure__ or () if filled(cell))
        yield from obj.__defaults__ or ()
        yield from (obj.__kwdefaults__ or {}).values()
        yield obj.__dict__
    elif isinstance(obj, types.MethodType):
        yield obj.__self__
        yield obj.__func__
    else:
        yield from gc.get_referents(obj)


def self_referencing(
    modules: list[nn.Module], written: list[int] | None = None, limit: int = 20_000
) -> bool:
    """Whether what the replicas keep of a tree (every module's attributes and hooks, its
    parameters' and buffers' hooks and attributes) leads back to its root module: a hook that
    is a bound method, a helper object or config holding the module, a closure over it, a
    tensor hook reading one of its attributes, at any depth.

    The process-wide replica table holds the root only weakly; an entry that reached it
    strongly would keep it alive for ever, so such a tree is not kept in that table. A search
    that grows past ``limit`` objects answers ``True``: not caching is always safe.
    ``written``: only the attributes of these modules (just refilled) are searched from.
    """
    root = modules[0]
    seen = {id(m) for m in modules}  # the tree's modules: their attributes are the start
    stack: list[Any] = []
    for i in range(len(modules)) if written is None else written:
        d = modules[i].__dict__
        for name, value in d.items():
            if name not in ("_parameters", "_buffers", "_modules"):
                stack.append(value)
        # The tree's tensors: their hooks and attributes (the set holds the tensors).
        for name in ("_parameters", "_buffers"):
            stack.extend(t for t in d[name].values() if t is not None)
    while stack:
        obj = stack.pop()
        if obj is root:
            return True
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            return True
        stack.extend(_referents(obj))
    return False


def _tensor_referents(tensor: torch.Tensor) -> Iterator[Any]:
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(tensor, name, None)
        if hooks:
            yield from hooks.values()
    extra = getattr(tensor, "__dict__", None)
    if extra:
        yield from extra.values()


def filled(cell: Any) -> bool:
    """Whether a closure cell holds a value (an empty one raises on reading)."""
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
