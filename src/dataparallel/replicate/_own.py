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
(``take``) and read at the start of the next (``written``): where the interpreter has write
stamps (``_common.stamps``), one read of every table's tag, about 1 µs for the tutorial CNN's
two replicas; elsewhere (CPython 3.10) a comparison of every entry's identity, slower, as
complete. What it does not see: an ``OrderedDict``'s ``move_to_end`` on a replica's hook table,
and the replicas of a module with a replication of its own (``_custom``), re-synced apart.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from itertools import chain
from typing import Any

from dataparallel._common.stamps import Stamps, stamps
from dataparallel.replicate._records import Node

__all__ = ["OwnWrites"]

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


def _contents(table: dict[Any, Any]) -> list[Any]:
    return [len(table), *table, *table.values()]


class OwnWrites:
    """The tables of a replica set's filled replicas, and what their forwards wrote since the
    last :meth:`take` (by module: the source's preorder index)."""

    __slots__ = ("_owners", "_saved", "_sources", "_stamps", "_tables", "_tried")

    def __init__(self) -> None:
        self._tables: list[dict[Any, Any]] = []
        self._sources: list[int] = []  # each table's module
        self._owners: list[object] = []
        self._stamps: Stamps | None = None
        self._tried = False  # whether stamps were made (or found unreadable) for these tables
        self._saved: list[list[Any]] = []  # without stamps: each table's contents

    def watch(self, nodes: Iterable[Node]) -> None:
        """Watch the tables of ``nodes`` (after a fill; the same objects as before, unless a
        replica's forward replaced one, which was a write of its dictionary)."""
        tables: list[dict[Any, Any]] = []
        sources: list[int] = []
        owners: list[object] = []
        for node in nodes:
            d = node.module.__dict__
            owners.append(node.module)
            for table in (d, *map(d.get, _TABLES)):
                if isinstance(table, dict):
                    tables.append(table)
                    sources.append(node.source.index)
        if len(tables) == len(self._tables) and all(map(operator.is_, tables, self._tables)):
            return
        self._tables, self._sources, self._owners = tables, sources, owners
        self._stamps, self._tried = None, False

    def take(self) -> None:
        """Keep the tables as they are now (after a sync wrote them)."""
        if not self._tried:  # (made at the first take: a set used for one call never pays)
            self._tried = True
            self._stamps = stamps(self._tables, owners=self._owners)
        if self._stamps is not None:
            self._stamps.take()
        else:
            self._saved = list(map(_contents, self._tables))

    def written(self) -> list[int]:
        """The modules (preorder indices) one of whose replicas' tables was written since
        :meth:`take`, in order; ``[]`` when none was (or nothing is watched yet)."""
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
        return sorted({self._sources[i] for i in moved})
