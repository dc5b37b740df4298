"""Walks over nested structures: flatten with paths, unflatten, leaves, map.

Plan, scatter, gather and the distributed helpers walk whole trees of containers with these:
:func:`flatten` (the leaves in order, with their paths if asked) and :func:`unflatten`,
:func:`leaves` (lazily), :func:`map_leaves`, :func:`map_tensors` (markers unwrapped) and
:func:`contains_array`. Every walk sees containers as
:func:`~dataparallel._common.kinds.container_kind` does, puts them back (unflatten, the maps)
with :func:`~dataparallel._common.rebuild.rebuild`, and refuses cycles and nesting deeper than
``MAX_DEPTH`` with :class:`TooDeep`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from dataparallel._common.kinds import WALKED, Kind, kind_of, path_key, struct_items
from dataparallel._common.rebuild import rebuild
from dataparallel.markers import Shared, Split

__all__ = [
    "MAX_DEPTH",
    "TooDeep",
    "TreeSpec",
    "contains_array",
    "flatten",
    "leaves",
    "map_leaves",
    "map_tensors",
    "unflatten",
]

# Containers nested deeper than this are refused: Python's stack is finite, and a container
# that contains itself would otherwise recurse until it overflows.
MAX_DEPTH = 100


class TooDeep(ValueError):
    """Containers nested more than ``MAX_DEPTH`` levels deep, or a cycle."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        super().__init__(
            f"{path or 'input'}: containers nested more than {MAX_DEPTH} levels deep, or a "
            f"container that contains itself, expected a tree; flatten the input, or pass a "
            f"copy without the back-reference"
        )


class TreeSpec:
    """The shape of a flattened tree: each container's kind, template and keys; ``None``
    children are leaves. :func:`unflatten` puts new leaves back into it."""

    __slots__ = ("children", "keys", "kind", "template")

    def __init__(
        self, kind: Kind, template: Any, keys: list[Any], children: list[TreeSpec | None]
    ) -> None:
        self.kind, self.template, self.keys, self.children = kind, template, keys, children

    @property
    def num_leaves(self) -> int:
        """How many leaves the tree has."""
        return sum(1 if c is None else c.num_leaves for c in self.children)


def flatten(
    tree: Any,
    /,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    paths: list[str] | None = None,
    root: str = "",
) -> tuple[list[Any], TreeSpec | None]:
    """The leaves of ``tree`` depth first, in order, and its spec (``None``: a single leaf).

    Pass a list as ``paths`` to have it filled with each leaf's path (``root['boxes'][0]``).
    ``is_leaf`` stops the walk at the values it accepts.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle; it names the
            path when ``paths`` is given.

    >>> out, spec = flatten({"x": [1, 2], "y": (3,)})
    >>> out, unflatten(spec, [10, 20, 30])
    ([1, 2, 3], {'x': [10, 20], 'y': (30,)})
    """
    out: list[Any] = []
    spec = _flatten(tree, out, is_leaf, paths, root, 0)
    return out, spec


def _flatten(
    obj: Any,
    out: list[Any],
    is_leaf: Callable[[Any], bool] | None,
    paths: list[str] | None,
    path: str,
    depth: int,
) -> TreeSpec | None:
    kind = WALKED.get(kind_of(obj))
    if kind is None or (is_leaf is not None and is_leaf(obj)):
        out.append(obj)
        if paths is not None:
            paths.append(path)
        return None
    if depth > MAX_DEPTH:
        raise TooDeep(path if paths is not None else None)
    keys, values = struct_items(obj, kind)
    if paths is None:
        children = [_flatten(v, out, is_leaf, None, path, depth + 1) for v in values]
    else:
        children = [
            _flatten(v, out, is_leaf, paths, path + path_key(kind, k), depth + 1)
            for k, v in zip(keys, values, strict=True)
        ]
    return TreeSpec(kind, obj, keys, children)


def unflatten(spec: TreeSpec | None, leaves: Iterable[Any], /) -> Any:
    """The tree of ``spec`` holding ``leaves`` in order, every container of its own type."""
    it = iter(leaves)
    if spec is None:
        return next(it)
    return _unflatten(spec, it)


def _unflatten(spec: TreeSpec, it: Iterator[Any]) -> Any:
    values = [next(it) if c is None else _unflatten(c, it) for c in spec.children]
    return rebuild(spec.kind, spec.template, spec.keys, values)


def leaves(
    tree: Any, /, *, is_leaf: Callable[[Any], bool] | None = None, _depth: int = 0
) -> Iterator[Any]:
    """The leaves of ``tree``, depth first, lazily (a search stops at the first match).

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    kind = WALKED.get(kind_of(tree))
    if kind is None or (is_leaf is not None and is_leaf(tree)):
        yield tree
        return
    if _depth > MAX_DEPTH:
        raise TooDeep
    for value in struct_items(tree, kind)[1]:
        yield from leaves(value, is_leaf=is_leaf, _depth=_depth + 1)


def map_leaves(
    fn: Callable[[Any], Any],
    tree: Any,
    /,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    _depth: int = 0,
) -> Any:
    """``tree`` with ``fn`` applied to every leaf, every container rebuilt with its own type.

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    kind = WALKED.get(kind_of(tree))
    if kind is None or (is_leaf is not None and is_leaf(tree)):
        return fn(tree)
    if _depth > MAX_DEPTH:
        raise TooDeep
    keys, values = struct_items(tree, kind)
    depth = _depth + 1
    return rebuild(
        kind, tree, keys, [map_leaves(fn, v, is_leaf=is_leaf, _depth=depth) for v in values]
    )


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    shared_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    _depth: int = 0,
) -> Any:
    """Apply ``fn`` to every tensor inside nested containers; markers are unwrapped.

    Tensors inside a ``dp.Shared`` get ``shared_fn`` instead (scatter moves them without
    casting them); other leaves are returned as they are (shared by reference).

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _depth > MAX_DEPTH:
        raise TooDeep
    if isinstance(obj, Shared):
        inner = fn if shared_fn is None else shared_fn
        return map_tensors(obj.obj, inner, inner, _depth + 1)
    if isinstance(obj, Split):
        return map_tensors(obj.obj, fn, shared_fn, _depth + 1)
    kind = WALKED.get(kind_of(obj))
    if kind is None:
        return obj
    keys, values = struct_items(obj, kind)
    depth = _depth + 1
    return rebuild(kind, obj, keys, [map_tensors(v, fn, shared_fn, depth) for v in values])


def contains_array(obj: Any, /) -> bool:
    """True when a tensor or ndarray lies anywhere inside ``obj`` (markers looked into).

    Raises:
        TooDeep: containers nested more than ``MAX_DEPTH`` levels, or a cycle.
    """
    for leaf in leaves(obj):
        if isinstance(leaf, torch.Tensor) or _is_ndarray(leaf):
            return True
        if isinstance(leaf, (Shared, Split)) and contains_array(leaf.obj):
            return True
    return False


def _is_ndarray(obj: Any) -> bool:
    return type(obj) is np.ndarray
