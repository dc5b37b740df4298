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
from dataparallel.replicate._records import Node, buffer_table
from dataparallel.replicate._written import WRITES

__all__ = ["OwnWrites", "alone_message", "alone_writes"]

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
    {
        *nn.Module().__dict__,
        "_is_replica",
        "_former_parameters",
        "zero_grad",
        SERIAL,
        HOOKS_SEEN,
        WRITES,
    }
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

    def after(
        self, snapshot: Any, replicas: list[Any], ran: bool, rebound: dict[int, Any], own: bool
    ) -> None:
        """Right after a call (``Replicas.after_call``): read :meth:`written` (the next one
        answers with it instead of reading again), and where replica 0 ran too (``ran``: not
        a later wave alone), :meth:`say` what a later replica wrote where replica 0 did not,
        as the module's ``snapshot`` (taken at the sync: what changed since is this call's)
        or, where replica 0 is a copy (not ``own``; the wrapper copies its writes back), that
        copy tells. ``rebound``: the names the rebinding search gave each replica its own
        value of, by module."""
        self._found = found = self._read()
        if found and ran and snapshot is not None:
            self.say(snapshot, replicas, rebound, own)

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

    def say(self, snapshot: Any, replicas: list[Any], rebound: dict[int, Any], own: bool) -> None:
        """Warn, once per module, of what :meth:`written` found a later replica wrote where
        replica 0 (the module, or where not ``own`` its copy) did not write: an attribute, or
        a table, as ``snapshot`` (taken at the sync) tells; see :meth:`after`."""
        moved: dict[tuple[int, int], list[str]] = {}  # by module and replica: its tables
        for i, place, table in self.moved:
            if (place >= 1 and i not in self._said) or not own:
                moved.setdefault((i, place), []).append(table)
        modules = snapshot.modules()
        if modules[0] is None:
            return
        names: dict[int, str] | None = None
        for (i, place), tables in moved.items():
            if place == 0 or i in self._said:  # (said of an earlier replica in this call)
                continue
            state = snapshot.state(i)
            before, keeps = state.before(), state.ref().__dict__
            theirs: dict[str, Any] = {}
            if "__dict__" in tables:  # (the attributes: those replica 0 did not write too)
                skip = _NOT_SHOWN.union(rebound.get(i, ()), before.get("_parameters") or ())
                theirs = _keys_written(before, replicas[place].nodes[i].module.__dict__, skip)
                if theirs:
                    first = keeps if own else replicas[0].nodes[i].module.__dict__
                    mine = _keys_written(before, first, skip)
                    theirs = {k: v for k, v in theirs.items() if k not in mine}
            others = _changed([t for t in tables if t != "__dict__"], replicas[place], i, keeps)
            if others:  # (the tables: those replica 0 did not write too)
                others -= (
                    state.written_tables()
                    if own
                    else _changed(moved.get((i, 0), []), replicas[0], i, keeps)
                )
            what = alone_writes(theirs, others, keeps)
            if what:
                self._said.add(i)
                if names is None:
                    names = {id(m): n for n, m in modules[0].named_modules(remove_duplicate=False)}
                warn_user(alone_message(names.get(id(modules[i]), ""), place, what))


_GONE = object()  # (``_keys_written``'s value of a name deleted)


def _changed(tables: list[str], replica: Any, index: int, module: dict[str, Any]) -> set[str]:
    """Of a replica's ``tables`` that moved (of the module at preorder ``index``), those that
    hold other entries than the fill gave them: children, parameters and buffers as the set
    installed them, hooks as the module's (``module``: its dictionary). A table written and
    put back (``torch.func.functional_call``, a weight deleted and set again, even as a plain
    attribute holding the same tensor) is unchanged."""
    node = replica.nodes[index]
    s, d = node.source, node.module.__dict__
    installed: dict[str, Any] = {"_modules": node.children}
    if replica.params_in is not None:
        params = dict.fromkeys(s.none_params)
        params.update(
            zip(s.param_names, map(replica.params_in.__getitem__, s.param_slots), strict=True)
        )
        installed["_parameters"] = params
    if replica.buffers_in is not None:
        installed["_buffers"] = buffer_table(s, replica.buffers_in)
    changed = set()
    for name in tables:
        table, expected = d.get(name), installed.get(name, module.get(name))
        if (
            name == "__dict__"
            or s.custom
            or not isinstance(table, dict)
            or not isinstance(expected, dict)
            or any(k not in expected for k in table)
            or any(table.get(k, d.get(k, _GONE)) is not v for k, v in expected.items())
        ):
            changed.add(name)
    return changed


def _keys_written(before: dict[str, Any], now: dict[str, Any], skip: Any) -> dict[str, Any]:
    """The names of a module's dictionary (``now``) set or deleted since ``before``, each with
    its value now (``_GONE``: deleted), less those in ``skip``."""
    written = {k: v for k, v in now.items() if k not in skip and before.get(k, _GONE) is not v}
    written.update((k, _GONE) for k in before if k not in now and k not in skip)
    return written


def alone_writes(theirs: dict[str, Any], tables: set[str], keeps: dict[str, Any]) -> list[str]:
    """What a later replica wrote on itself where replica 0 (the module, or its copy) did not,
    as a message shows it: each attribute set or deleted (``theirs``: ``_keys_written``), a
    plain value with the module's (``keeps``: its dictionary), another by its type; then each
    of ``tables`` by its kind. ``[]`` where replica 0 made every such write too (a counter
    every replica steps): then the module holds what one device would."""
    what = []
    for key, value in theirs.items():
        if value is _GONE:
            what.append(f"del {key}")
        elif type(value) in ATOMS:
            what.append(f"{key} = {value!r} (the module keeps {keeps.get(key)!r})")
        else:
            what.append(f"{key} (a {type(value).__name__})")
    return what + sorted({_WRITTEN[t] for t in tables if t in _WRITTEN})


def alone_message(name: str, place: int, what: list[str]) -> str:
    """The warning for what replica ``place``'s forward wrote on its replica of the module
    named ``name`` where the module was not written (``what``: :func:`alone_writes`), what
    happens to it, and how to keep it."""
    return (
        f"module{'.' + name if name else ''}: replica {place}'s forward wrote its own state "
        f"in this call ({', '.join(what[:6])}), where replica 0, the module itself, did not "
        f"write that. A later replica's own write is dropped: the module keeps its state, and "
        f"the next calls compute every chunk from it; on one device this forward would have "
        f"written the module. To keep a write that some chunk makes, make it from the "
        f"wrapper's output after the call, or keep the state in a parameter with "
        f"requires_grad=False written in place (a write that a later replica alone makes "
        f"lands on the module; see the guide, 'A forward that writes its parameters')"
    )
