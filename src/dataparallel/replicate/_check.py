"""What the replicas of a module tree copy, and how a call tells that any of it changed.

Two checks, one cheap and complete, one exact about structure:

- :class:`Snapshot` holds the identity of everything a replica copies from its source module:
  every value of every module's ``__dict__`` (plain attributes, training flags, the tables
  themselves), the contents of its parameter, buffer, child and hook tables, the names in the
  first three and in the module's dictionary, and each parameter's and buffer's storage
  address (``p.data = t``, ``b.set_(t)`` and ``torch.utils.swap_tensors`` keep the tensor
  object but move its data;
  compared where a replica holds a copy: a set whose replicas share every parameter object and
  hold no buffer sees new data through the tensor itself).
  ``Snapshot.same`` first reads the write stamps of every table (``_common.stamps``: one
  gather, where the interpreter keeps them) and compares all of it in C
  (``map(operator.is_, ...)``) only when one moved: any write is seen, through torch's methods or
  past them (``module._parameters[k] = p`` as loaders and ``torch.func.functional_call`` do,
  ``module.__dict__[k] = v``, ``child.compile()``), and nothing outside the tree is looked at,
  so nothing outside it can slow the check. ``Snapshot.changed`` then names the modules that
  differ, so only their replicas are refilled.
- :func:`structure_key` is the structure (submodules, their types, the names and identities of
  their children, parameters and buffers, each parameter's storage, each buffer's shape, dtype
  and device, the hook counts): when it still holds, the replicas are refilled in place;
  otherwise they are built again.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch import nn

from dataparallel._common.checks import check_initialized
from dataparallel._common.stamps import Stamps
from dataparallel._common.stamps import stamps as make_stamps

__all__ = [
    "Scripted",
    "Snapshot",
    "fingerprint",
    "moved_data_only",
    "structure_key",
]


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
    return modules, structure_key(modules)


class Scripted(Exception):
    """A TorchScript module somewhere in the tree (raised by ``fingerprint``)."""


def structure_key(modules: list[nn.Module]) -> list[Any]:
    """What defines the structure of ``modules`` (a preorder walk): checked on every call.

    Taken over the cached preorder list, it equals the key of a fresh walk whenever the
    structure is unchanged, and differs from the cached one whenever it changed: a replaced
    child shows in its parent's entry, which comes first in preorder.
    """
    key: list[Any] = []
    add = key.append
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
                add(None if p is None else (id(p), _ptr(p)))
        buffers = d["_buffers"]
        if buffers:
            add(("b", *buffers))
            for b in buffers.values():
                add(None if b is None else (b.shape, b.dtype, b.device))
        add(0)  # end of this module
    return key


def moved_data_only(old: list[Any], new: list[Any], placed: dict[int, Any]) -> bool:
    """Whether structure key ``new`` differs from ``old`` only in parameters whose data moved
    to a new address with the device, dtype and shape they had (``placed``: id -> the
    parameter and those three, as the set was built): a forward or a loop that assigns
    ``p.data`` (a spectral norm's ``u.data = ...`` on every call). The replicas follow such a
    write without a rebuild (shared, copied on each call with grad, compared by shape and
    dtype without), and a rebuild on every call would cost a refill and lose the copies an
    earlier call's graph saved. A ``.to()`` changes the device or dtype: rebuilt."""
    if len(old) != len(new):
        return False
    for a, b in zip(old, new, strict=True):
        if a == b:
            continue
        if type(a) is not tuple or type(b) is not tuple or len(a) != 2 or len(b) != 2:
            return False
        entry = placed.get(a[0]) if a[0] == b[0] else None
        if entry is None:
            return False
        p, device, dtype, shape = entry
        if p.device != device or p.dtype != dtype or p.shape != shape:
            return False
    return True


# A module's tables whose contents a replica copies: the values and names of the first three
# are part of the snapshot, and the values and length of the hook tables (a hook swapped for
# another keeps the count). The other hook tables (state_dict and load hooks) do not change
# what a replica computes, and the ``*_with_kwargs``/``*_always_called`` tables only ever
# change together with the forward hook tables.
_STRUCTURE = ("_parameters", "_buffers", "_modules")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_KEYED = frozenset({"__dict__", *_STRUCTURE})  # the tables whose names a snapshot keeps
# (``const_data_ptr``: ``data_ptr`` would make a copy-on-write tensor copy its data)
_DATA_PTR: Callable[[torch.Tensor], int] = torch.Tensor.const_data_ptr  # type: ignore[attr-defined]
_IS = operator.is_
_DICT = operator.attrgetter("__dict__")
_VALUES = dict.values


def _ptr(param: torch.Tensor) -> int | None:
    try:
        return _DATA_PTR(param)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _ptrs(tensors: list[torch.Tensor]) -> list[int | None]:
    """Each tensor's storage address: ``.to()`` (with ``swap_tensors`` on conversion),
    ``t.data = u``, ``t.set_(u)`` and ``torch.utils.swap_tensors`` keep the tensor object but
    move its data. ``None`` for a tensor with no storage to point at (a functorch wrapper, a
    sparse tensor, a subclass), for which the identity check alone decides."""
    try:
        return list(map(_DATA_PTR, tensors))
    except (RuntimeError, TypeError, NotImplementedError):  # one without: check the others
        return list(map(_ptr, tensors))


class _ModuleState:
    """One module's part of a :class:`Snapshot`."""

    __slots__ = (
        "cls",
        "counted",
        "d",
        "keyed",
        "keys",
        "lens",
        "loose",
        "loose_vals",
        "named",
        "names",
        "ptrs",
        "ref",
        "tensors",
        "vals",
        "valued",
    )

    def __init__(self, module: nn.Module) -> None:
        d = module.__dict__
        # Its class and its dictionary object: ``module.__class__ = Other`` and
        # ``module.__dict__ = {...}`` write no table. The module itself held weakly: the
        # process-wide replica table holds a root only weakly, and a snapshot lives in it.
        self.ref, self.cls, self.d = weakref.ref(module), type(module), d
        tables = [d.get(k) for k in _STRUCTURE]
        named = [t for t in tables if isinstance(t, dict)]
        self.named: list[dict[Any, Any]] = named
        hooks = [t for t in (d.get(k) for k in _HOOKS) if isinstance(t, dict)]
        # each counted table's name (``written_tables``)
        self.names = [
            "__dict__",
            *(k for k in (*_STRUCTURE, *_HOOKS) if isinstance(d.get(k), dict)),
        ]
        # The hooks themselves too, where there are some (one removed and another registered
        # keeps the count); a table empty now changes its count with its first hook.
        self.valued: list[dict[Any, Any]] = [d, *named, *(t for t in hooks if t)]
        self.counted: list[Any] = [d, *named, *hooks]
        self.lens = list(map(len, self.counted))
        self.vals = list(chain.from_iterable(map(_VALUES, self.valued)))
        # The names too: of the named tables, and of the module's own dictionary (an attribute
        # deleted and another set to the same object keeps every value and the length).
        self.keyed: list[dict[Any, Any]] = [d, *named]
        self.keys = list(chain.from_iterable(self.keyed))
        # The tables that are not plain dictionaries (hook tables are ``OrderedDict``s), read
        # in their own order: ``dict.values`` reads the storage, which ``move_to_end`` keeps.
        self.loose: list[Iterable[Any]] = [
            *(t.values() for t in self.valued if type(t) is not dict),
            *(t.keys() for t in named if type(t) is not dict),
        ]
        self.loose_vals = list(chain.from_iterable(self.loose))
        # Parameters and buffers alike: a buffer's data moved past torch's methods must reach
        # the private copies, which the fast path refreshes from the tensors it saw last.
        self.tensors = [
            t
            for table in (d.get("_parameters"), d.get("_buffers"))
            if table
            for t in table.values()
            if t is not None
        ]
        self.ptrs = _ptrs(self.tensors)

    def same(self) -> bool:
        return (
            (module := self.ref()) is not None
            and type(module) is self.cls
            and module.__dict__ is self.d
            and list(map(len, self.counted)) == self.lens
            and all(map(operator.is_, chain.from_iterable(map(_VALUES, self.valued)), self.vals))
            and all(map(operator.is_, chain.from_iterable(self.keyed), self.keys))
            and all(map(operator.is_, chain.from_iterable(self.loose), self.loose_vals))
            and _ptrs(self.tensors) == self.ptrs
        )

    def before(self) -> dict[str, Any]:
        """The module's own dictionary as the snapshot saw it."""
        n = self.lens[0]
        return dict(zip(self.keys[:n], self.vals[:n], strict=True))

    def written_tables(self) -> set[str]:
        """The names of the module's tables (``"__dict__"`` and those in it) written since
        the snapshot: each compared with the names and values it held then."""
        module = self.ref()
        d = getattr(module, "__dict__", {})
        written = set()
        at_key = at_value = 0
        for name, table, n in zip(self.names, self.counted, self.lens, strict=True):
            keys = self.keys[at_key : at_key + n] if name in _KEYED else None
            values = self.vals[at_value : at_value + n]  # (a hook table empty then: none)
            at_key += n if keys is not None else 0
            at_value += n
            now = d if name == "__dict__" else d.get(name)
            if (
                now is not table
                or len(now) != n
                or not all(map(operator.is_, _VALUES(now), values))
                or (keys is not None and not all(map(operator.is_, now, keys)))
            ):
                written.add(name)
        return written


class Snapshot:
    """The identity of everything the replicas of a module tree copy from it.

    Taken after the replicas are filled; :meth:`same` on the next call says whether any of it
    was written since: in one read of the tables' write stamps when none was (about 1 µs for
    the tutorial CNN), else in a few C-level passes over the identities (about 0.8 µs a
    module). It holds the values it saw, so an identity cannot be reused by a new object while
    it is kept.
    """

    __slots__ = (
        "_counted",
        "_expect",
        "_held",
        "_keyed",
        "_lens",
        "_loose",
        "_loose_values",
        "_modules",
        "_ptrs",
        "_root",
        "_stampable",
        "_stamps",
        "_storage",
        "_tensors",
        "_valued",
        "_values",
        "_views",
    )
    # (``_views``: the live views of every table's values, then of the keyed tables' keys, in
    # the order of ``_values``: one flat list, read by one ``chain`` in ``same``. ``_stamps``:
    # the write stamps of every table, where the interpreter has them; ``_loose``: the views
    # of the tables that are not plain dictionaries (a hook table is an ``OrderedDict``, whose
    # order a stamp does not see), compared on every call with ``_loose_values``.)

    def __init__(self, modules: list[nn.Module], storage: bool = True) -> None:
        self._modules = [_ModuleState(m) for m in modules]
        # Whether ``same`` watches each tensor's storage: a replica set whose replicas share
        # every parameter object and copy no buffer (every CPU list of a model without
        # buffers) sees a tensor's new data through the tensor itself.
        self._storage = storage
        # Made at the first full comparison that finds the tree unchanged (a snapshot of a set
        # built for one call never pays for them), kept while the tables are the same objects.
        self._stamps: Stamps | None = None
        self._stampable = True
        self._counted: list[dict[Any, Any]] = []
        self._join()

    def _join(self) -> None:
        """The tree's flat lists, in the order :meth:`same` reads them: every table's values,
        then the names."""
        states = self._modules
        before = self._counted
        self._valued = list(chain.from_iterable(s.valued for s in states))
        self._counted = list(chain.from_iterable(s.counted for s in states))
        if self._stamps is not None and not (
            len(before) == len(self._counted) and all(map(operator.is_, before, self._counted))
        ):
            self._stamps = None  # other tables now: made again at the next full comparison
        self._keyed = list(chain.from_iterable(s.keyed for s in states))
        self._lens = list(chain.from_iterable(s.lens for s in states))
        # Live views of the same dictionaries: read in ``same`` without a call per dictionary
        # (a view shows its dictionary's values, or keys, as they are now).
        self._views: list[Iterable[Any]] = [
            *map(_VALUES, self._valued),
            *map(dict.keys, self._keyed),
        ]
        self._values = [
            *chain.from_iterable(s.vals for s in states),
            *chain.from_iterable(s.keys for s in states),
        ]
        self._tensors = (
            list(chain.from_iterable(s.tensors for s in states)) if self._storage else []
        )
        self._ptrs = _ptrs(self._tensors)
        self._loose = list(chain.from_iterable(s.loose for s in states))
        self._loose_values = list(chain.from_iterable(s.loose_vals for s in states))
        # Read on every call in one pass (``same``): the root's class and dictionary object,
        # the other modules' classes (``type``: no table holds it), then their dictionaries,
        # then the loose tables' contents in their own order. The root weakly (see
        # ``_ModuleState``), the others as the replica set holds them.
        self._root = states[0].ref
        self._held = [s.ref() for s in states[1:]]
        self._expect = [
            states[0].cls,
            states[0].d,
            *(s.cls for s in states[1:]),
            *(s.d for s in states[1:]),
            *self._loose_values,
        ]

    def same(self) -> bool:
        """Whether nothing in the tree was written since the snapshot.

        Where the interpreter stamps its dictionaries, one read of every table's stamp answers
        when none was written (the tables that are not plain dictionaries are compared too);
        otherwise, or when one was written, every identity is compared in one pass in C (a
        table written back to what it held leaves the tree the same, and the stamps are taken
        again).
        """
        stamps = self._stamps
        if stamps is None or not stamps.same():
            if not (
                list(map(len, self._counted)) == self._lens
                and all(map(operator.is_, chain.from_iterable(self._views), self._values))
            ):
                return False
            if stamps is None and self._stampable:
                stamps = self._stamps = make_stamps(
                    self._counted, owners=[self._root(), *self._held]
                )
                self._stampable = stamps is not None  # (not tried again where none can be)
            if stamps is not None:
                stamps.take()
        # Besides the stamps: each module's class and dictionary object, the order of the
        # tables that are not plain dictionaries (a dead root: ``NoneType``, not its class),
        # and the watched storage addresses.
        root = self._root()
        held = self._held
        return all(
            map(
                _IS,
                chain(
                    (type(root), getattr(root, "__dict__", None)),
                    map(type, held),
                    map(_DICT, held),
                    chain.from_iterable(self._loose),
                ),
                self._expect,
            )
        ) and (not self._tensors or _ptrs(self._tensors) == self._ptrs)

    def modules(self) -> list[nn.Module | None]:
        """The modules, in preorder (``None`` for a root no longer alive)."""
        return [self._root(), *self._held]

    def changed(self) -> list[int]:
        """The preorder indices of the modules written since the snapshot."""
        return [i for i, state in enumerate(self._modules) if not state.same()]

    def state(self, index: int) -> _ModuleState:
        """What the snapshot saw of the module at preorder ``index``."""
        return self._modules[index]

    def retake(self, modules: list[nn.Module], indices: list[int]) -> None:
        """Take the modules at ``indices`` again (after their replicas were refilled). The
        stamps are taken at the next :meth:`same` that compares every identity: another module
        may have been written too."""
        for i in indices:
            self._modules[i] = _ModuleState(modules[i])
        self._join()
