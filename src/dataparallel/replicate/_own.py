"""What the replicas' own forwards wrote on themselves since their last sync.

A replica after the first is a copy whose writes are dropped (the guide, "A forward that writes
its own state"): the module keeps what replica 0 (the module itself) wrote. The replicas are
refilled from the module when the module's snapshot sees it written, but a write that only some
chunk makes (a flag set when the chunk holds a flagged sample, a hook registered on the first
long input) can come from a later replica alone, leaving the module unwritten: without a look
at the replicas themselves, that replica would keep its write and compute its chunk of every
later call from state no device holds.

:class:`OwnWrites` watches, on each replica the set refills, the module's dictionary and the
tables in it (parameters, buffers, children, the hook tables a snapshot watches), which the
fills keep as the same objects from one call to the next. It is taken after each sync
(``take``) and read right after the call (``after``, from ``check_writes``), or else at the
start of the next sync (``written``): where the interpreter has write
stamps (``_common.stamps``), one read of every table's tag, about 1 µs for the tutorial CNN's
two replicas; elsewhere (CPython 3.10) a comparison of every entry's identity, slower, as
complete. What it does not see: an ``OrderedDict``'s ``move_to_end`` on a replica's hook table,
and the replicas of a module with a replication of its own (``_custom``), re-synced apart.

A write a later replica made where the module was not written (replica 0, the module itself,
wrote nothing there) is a difference from one device, whose forward would have written the
module: the call that wrote says so (:func:`alone_message`), once per module and replica set.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from itertools import chain
from typing import Any

from torch import nn

from dataparallel._common.kinds import ATOMS
from dataparallel._common.stamps import Stamps, stamps
from dataparallel._common.warn import warn_user
from dataparallel.replicate._rebind import HOOKS_SEEN, SERIAL
from dataparallel.replicate._records import Node

__all__ = ["OwnWrites", "alone_message"]

# A replica's tables besides its ``__dict__``: what a write of an attribute, parameter, buffer,
# child or hook changes (the ``*_with_kwargs``/``*_always_called`` tables change only with the
# forward hook tables).
_TABLES = (
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


# What a message calls a write of each table (a write of the ``__dict__`` itself: attributes).
_WRITTEN = {
    "_parameters": "a parameter",
    "_buffers": "a buffer",
    "_modules": "a child module",
    **{name: "a hook" for name in _TABLES[3:]},
}
# Names a replica's dictionary holds apart from its module's (``_fill``, ``_install``,
# ``nn.Module``'s bookkeeping); a message shows the values that are atoms (``ATOMS``).
_NOT_SHOWN = frozenset(
    {*nn.Module().__dict__, "_is_replica", "_former_parameters", "zero_grad", SERIAL, HOOKS_SEEN}
)


def _contents(table: dict[Any, Any]) -> list[Any]:
    return [len(table), *table, *table.values()]


class OwnWrites:
    """The tables of a replica set's filled replicas, and what their forwards wrote since the
    last :meth:`take` (by module: the source's preorder index)."""

    __slots__ = (
        "_found",
        "_owners",
        "_said",
        "_saved",
        "_sources",
        "_stamps",
        "_tables",
        "_tried",
        "moved",
    )

    def __init__(self) -> None:
        self._tables: list[dict[Any, Any]] = []
        # each table's module (preorder index), replica (its place in the set) and name
        self._sources: list[tuple[int, int, str]] = []
        # what the last ``written`` found: (module, replica, table name) of each moved table
        self.moved: list[tuple[int, int, str]] = []
        self._said: set[int] = set()  # the modules ``say`` warned of
        self._found: list[int] | None = None  # what ``after`` read, for the next ``written``
        self._owners: list[object] = []
        self._stamps: Stamps | None = None
        self._tried = False  # whether stamps were made (or found unreadable) for these tables
        self._saved: list[list[Any]] = []  # without stamps: each table's contents

    def watch(self, nodes: Iterable[tuple[int, Node]]) -> None:
        """Watch the tables of ``nodes`` (each with its replica's place in the set; after a
        fill: the same objects as before, unless a replica's forward replaced one, which was a
        write of its dictionary)."""
        tables: list[dict[Any, Any]] = []
        sources: list[tuple[int, int, str]] = []
        owners: list[object] = []
        for place, node in nodes:
            d = node.module.__dict__
            owners.append(node.module)
            for name, table in (("__dict__", d), *((k, d.get(k)) for k in _TABLES)):
                if isinstance(table, dict):
                    tables.append(table)
                    sources.append((node.source.index, place, name))
        if len(tables) == len(self._tables) and all(map(operator.is_, tables, self._tables)):
            return
        self._tables, self._sources, self._owners = tables, sources, owners
        self._stamps, self._tried = None, False

    def take(self) -> None:
        """Keep the tables as they are now (after a sync wrote them)."""
        self._found = None
        if not self._tried:  # (made at the first take: a set used for one call never pays)
            self._tried = True
            self._stamps = stamps(self._tables, owners=self._owners)
        if self._stamps is not None:
            self._stamps.take()
        else:
            self._saved = list(map(_contents, self._tables))

    def after(self, snapshot: Any, replicas: list[Any], ran: bool) -> None:
        """Right after a call (``Replicas.after_call``): read :meth:`written` (the next one
        answers with it instead of reading again), and where replica 0 ran too (``ran``: not
        a later wave alone), :meth:`say` what a later replica wrote where replica 0 wrote
        nothing, as the module's ``snapshot`` tells (taken at the sync: what changed since is
        this call's)."""
        self._found = found = self._read()
        if found and ran and snapshot is not None:
            wrote = [] if snapshot.same() else snapshot.changed()
            self.say(snapshot.modules(), replicas, wrote)

    def written(self) -> list[int]:
        """The modules (preorder indices) one of whose replicas' tables was written since
        :meth:`take`, in order; ``[]`` when none was (or nothing is watched yet)."""
        found, self._found = self._found, None
        return self._read() if found is None else found

    def _read(self) -> list[int]:
        marks = self._stamps
        if marks is not None:
            if marks.same():
                return []
            moved: Iterable[int] = marks.moved()
        elif self._saved:
            moved = [
                i
                for i, (table, saved) in enumerate(zip(self._tables, self._saved, strict=True))
                if len(table) != saved[0]
                or not all(map(operator.is_, chain(table, table.values()), saved[1:]))
            ]
        else:
            return []
        self.moved = [self._sources[i] for i in moved]
        return sorted({module for module, _, _ in self.moved})

    def say(self, modules: list[Any], replicas: list[Any], wrote: list[int]) -> None:
        """Warn, once per module, of what :meth:`written` found a later replica wrote where
        the module (``modules``, in preorder; replica 0's writes land there) was not written
        (``wrote``: the modules that were)."""
        alone: dict[int, tuple[int, list[str]]] = {}
        for i, place, table in self.moved:
            if place >= 1 and i not in wrote and i not in self._said:
                alone.setdefault(i, (place, []))[1].append(table)
        if not alone or modules[0] is None:
            return
        names = {id(m): name for name, m in modules[0].named_modules(remove_duplicate=False)}
        for i, (place, tables) in alone.items():
            self._said.add(i)
            replica = replicas[place].nodes[i].module
            name = names.get(id(modules[i]), "")
            warn_user(alone_message(name, modules[i], replica, place, tables))


def alone_message(
    name: str, module: nn.Module, replica: nn.Module, place: int, tables: list[str]
) -> str:
    """The warning for a write replica ``place``'s forward made on its replica of ``module``
    (named ``name``) where the module was not written: what it wrote (its ``tables``, by
    name, and the plain values it set or deleted), what happens to it, and how to keep it."""
    mine, theirs = module.__dict__, replica.__dict__
    what = [
        f"{key} = {theirs[key]!r} (the module keeps {mine.get(key)!r})"
        for key in theirs
        if key not in _NOT_SHOWN
        and type(theirs[key]) in ATOMS
        and (key not in mine or (type(mine[key]) in ATOMS and mine[key] != theirs[key]))
    ]
    what += [f"del {key}" for key in mine if key not in theirs and key not in _NOT_SHOWN]
    what += sorted({_WRITTEN[t] for t in tables if t in _WRITTEN})
    return (
        f"module{'.' + name if name else ''}: replica {place}'s forward wrote its own state "
        f"in this call ({', '.join(what[:6]) or 'an attribute'}), where replica 0, the "
        f"module itself, wrote nothing there. A later replica's own write is dropped: the "
        f"module keeps its state, and the next calls compute every chunk from it; on one "
        f"device this forward would have written the module. To keep a write that some "
        f"chunk makes, make it from the wrapper's output after the call, or keep the state in "
        f"a parameter with requires_grad=False written in place (a write that a later "
        f"replica alone makes lands on the module; see the guide, 'A forward that writes its "
        f"parameters')"
    )
