"""The records a replica set is made of: one per source module, per device, per replica.

:class:`dataparallel.replicate._replicas.Replicas` keeps a tree of these instead of lists that
would have to stay aligned by position: a :class:`Source` per module of the source tree, a
:class:`Replica` per device (the replica of the whole tree there), a :class:`Node` per
(device, module), and a :class:`Target` per device the parameters are used on. Parameters and
buffers are deduplicated (tied weights get one copy per device): records name them by their
slot in the set's ``params`` and ``buffers`` lists. All use ``__slots__``: the sync reads their
fields on every call.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

__all__ = [
    "HOOK_TABLES",
    "NOT_YET",
    "Key",
    "Node",
    "ParameterTable",
    "Ready",
    "Replica",
    "Source",
    "Target",
    "buffer_table",
    "device_key",
    "own_hooks",
    "tensor_slots",
]

Key = tuple[str, int]


def device_key(device: torch.device) -> Key:
    """A device as a hashable pair: ``"mps"`` and ``"mps:0"`` are one device; resolved CUDA
    devices always carry an index."""
    return (device.type, device.index or 0)


class Source:
    """One module of the source tree, as its replicas need it (fixed for the replica set).

    ``module`` is ``None`` for the root, which the process-wide table holds only weakly: the
    caller passes it in. ``through``: the index of the module an ``OptimizedModule`` wraps
    (its replicas are that module's), else ``None``. ``plain``: no tensors, no names that hold
    ``None`` and no custom replication, the fast case of a refill (most modules).
    """

    __slots__ = (
        "buffer_names",
        "buffer_slots",
        "custom",
        "index",
        "module",
        "none_buffers",
        "none_params",
        "param_names",
        "param_slots",
        "plain",
        "through",
    )

    def __init__(self, index: int, module: nn.Module | None, through: int | None) -> None:
        self.index = index
        self.module = module
        self.through = through
        self.param_names: tuple[str, ...] = ()
        self.param_slots: tuple[int, ...] = ()
        self.none_params: tuple[str, ...] = ()
        self.buffer_names: tuple[str, ...] = ()
        self.buffer_slots: tuple[int, ...] = ()
        self.none_buffers: tuple[str, ...] = ()
        self.custom = False
        self.plain = True


class Node:
    """One replica of one module: the replica object, its source, the children its
    ``__dict__`` gets (replicas on the same device), its own hook tables (see ``own_hooks``)
    and its own children, parameter and buffer tables (``tables``: made at its first fill,
    refilled in place from then on, so a watch of them holds; ``_own``)."""

    __slots__ = ("children", "hooks", "module", "source", "tables")

    def __init__(self, module: nn.Module, source: Source) -> None:
        self.module = module
        self.source = source
        self.children: dict[str, nn.Module | None] = {}
        self.hooks: list[Any] = [None] * len(HOOK_TABLES)
        self.tables: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None


class Replica:
    """The replica of the whole tree on one device.

    ``nodes``: one per source module, in preorder (an ``OptimizedModule``'s shares its inner
    module's replica object). ``full``: the nodes whose tensors ``_install`` puts in (every
    module that is neither plain nor an ``OptimizedModule``). ``private``: per buffer slot, the
    private copy this replica uses, or ``None`` where it uses the module's own tensor (replica
    0 on the buffer's device); ``private_slots`` lists the others. ``params_in`` and
    ``buffers_in``: the tensor lists last installed (``None``: install everything).
    """

    __slots__ = (
        "buffers_in",
        "device",
        "full",
        "key",
        "nodes",
        "params_in",
        "private",
        "private_slots",
    )

    def __init__(self, device: torch.device, nodes: list[Node], private: list[Any]) -> None:
        self.device = device
        self.key = device_key(device)
        self.nodes = nodes
        self.full = [n for n in nodes if not n.source.plain and n.source.through is None]
        self.private: list[torch.Tensor | None] = private
        self.private_slots = [i for i, mine in enumerate(private) if mine is not None]
        self.params_in: list[torch.Tensor] | None = None
        self.buffers_in: list[torch.Tensor] | None = None

    def buffers(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers this replica uses: the module's own where it has no private copy."""
        return [b if mine is None else mine for b, mine in zip(buffers, self.private, strict=True)]


class Target:
    """The parameters as the replicas on one device use them.

    ``tensors``: per parameter slot, the parameter itself where it lives on this device, else
    its copy here (the parameter until the first sync makes one); ``remote`` lists the
    copied slots. ``mode``: the grad mode every copy was made in and may be refreshed in
    place under (``None``: never, they were made with grad enabled or not at all).
    ``frozen``: the copies of parameters that do not require grad, kept for calls with grad.
    """

    __slots__ = ("device", "frozen", "key", "mode", "remote", "tensors")

    def __init__(self, key: Key, params: list[nn.Parameter]) -> None:
        self.key = key
        self.device = torch.device(*key)
        self.tensors: list[torch.Tensor] = list(params)
        self.remote = [i for i, p in enumerate(params) if device_key(p.device) != key]
        self.mode: str | None = None
        # slot -> (the parameter, its copy here): copies of parameters that do not require
        # grad, kept as objects across calls with grad and rebound to each call's value
        self.frozen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class Ready:
    """What a sync that wrote or made every private buffer copy in place leaves for the
    next: in the same mode, on the same buffers list and with no graph holding a copy or an
    alias of one, it is one fused copy of ``sources`` into ``dests``.

    ``storages``: the address of each copy's storage, whose Python object ``kept`` holds, so
    that its use count reads the same on every call until an alias appears (reading it through
    ``tensor.untyped_storage()`` each call would cost a Python object per copy). ``watched``:
    each buffer copied once, and ``shapes`` theirs: the fused copy broadcasts, so a buffer
    resized in place to a shape that broadcasts (``b.resize_(1)``, same address) would not
    fail it.
    """

    __slots__ = (
        "buffers",
        "dests",
        "inference",
        "kept",
        "shapes",
        "sources",
        "storages",
        "watched",
    )

    def __init__(
        self,
        inference: bool,
        buffers: list[torch.Tensor],
        dests: list[torch.Tensor],
        sources: list[torch.Tensor],
    ) -> None:
        self.inference = inference
        self.buffers = buffers
        self.dests = dests
        self.sources = sources
        self.kept = [d.untyped_storage() for d in dests]
        self.storages = [s._cdata for s in self.kept]
        self.watched = list({id(s): s for s in sources}.values())
        self.shapes = [s.shape for s in self.watched]


def tensor_slots(
    table: dict[str, Any], tensors: list[Any], index: dict[int, int]
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """A module's parameter or buffer table as slots of ``tensors`` (each tensor once, by
    identity, so tied weights share a slot): the names of the tensors, their slots, and the
    names that hold ``None``."""
    names: list[str] = []
    slots: list[int] = []
    for name, t in table.items():
        if t is not None:
            names.append(name)
            slots.append(index.setdefault(id(t), len(tensors)))
            if slots[-1] == len(tensors):
                tensors.append(t)
    return tuple(names), tuple(slots), tuple(k for k, t in table.items() if t is None)


class ParameterTable(dict[str, Any]):
    """A replica's ``_parameters``, whose writes reach the replica's attributes.

    A replica holds its parameter tensors twice: in ``_parameters`` (so ``self.parameters()``
    and ``state_dict()`` list them) and as attributes of its ``__dict__`` (so ``self.weight``
    resolves without ``nn.Module.__getattr__``). An attribute shadows the table, so a write to
    the table alone in forward would not be what forward then reads: ``torch.func.
    functional_call`` (MAML's inner step) and ``torch.nn.utils.stateless`` swap parameters by
    ``module._parameters[name] = tensor``, as a weight dropped out in place (AWD-LSTM's
    ``WeightDrop``) does; the replicas would compute with their own weights, silently, where
    one device (and torch's replicas, which keep parameters as attributes only) computes with
    the new ones. So an item set, updated, popped, deleted or cleared here is set or dropped in
    the replica's ``__dict__`` too, where it is an attribute (``owner``: a weak reference to
    the replica, so a replica dropped is freed at once, with no cycle for the collector). The
    install writes both at once (``dict.update``, which does not pass through here)."""

    __slots__ = ("owner",)

    def __init__(self, owner: nn.Module, *args: Any) -> None:
        super().__init__(*args)
        self.owner = weakref.ref(owner)

    def _attrs(self) -> dict[str, Any]:
        owner = self.owner()
        return {} if owner is None else owner.__dict__

    def __setitem__(self, key: str, value: Any) -> None:
        dict.__setitem__(self, key, value)
        attrs = self._attrs()
        if key in attrs:
            attrs[key] = value

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self, key)
        self._attrs().pop(key, None)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            self._attrs().pop(key, None)
        return dict.pop(self, key, *default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> ParameterTable:  # type: ignore[override,misc]
        self.update(other)
        return self

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def popitem(self) -> tuple[str, Any]:
        key, value = dict.popitem(self)
        self._attrs().pop(key, None)
        return key, value

    def clear(self) -> None:
        attrs = self._attrs()
        for key in self:
            attrs.pop(key, None)
        dict.clear(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """A plain dict when pickled or copied (``torch.save(replica)``): the weak reference
        to the replica cannot be, and a copy has its own attributes to keep in line."""
        return dict, (dict(self),)


def buffer_table(source: Source, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """A replica's ``_buffers`` for ``source``: ``buffers`` by slot, in the source's order
    (names that hold ``None`` first)."""
    table: dict[str, torch.Tensor | None] = dict.fromkeys(source.none_buffers)
    names, slots = source.buffer_names, source.buffer_slots
    table.update(zip(names, map(buffers.__getitem__, slots), strict=True))
    return table


# A private buffer copy not made yet (the first sync makes it).
NOT_YET: Any = object()

# The hook tables a replica holds its own copy of: a hook registered during a replica's forward
# (lazily, as transformers' output capture does) must land once, on the module, through
# replica 0, as on one device.
HOOK_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)


def own_hooks(d: dict[str, Any], mine: list[Any]) -> None:
    """Give a replica's refilled ``__dict__`` hook tables of its own, equal to its source's.

    A replica's ``__dict__`` is a shallow copy of its source's: without this, a hook registered
    during a replica's forward would land in the user's module too and fire twice from then on
    (torch's replicate has that flaw). ``mine`` holds the replica's tables between fills, each
    made once as a copy of its source's and refilled in place from then on (unless both are
    empty, the usual case), so the replica always starts with its source's hooks, nothing it
    registers outlives the next fill, and a watch of its tables (``_own``) holds.
    """
    for k, name in enumerate(HOOK_TABLES):
        src = d.get(name)
        if src is None:
            continue
        table = mine[k]
        if table is None or type(table) is not type(src):
            mine[k] = table = src.copy()
        elif src or table:
            table.clear()
            table.update(src)
        d[name] = table
