"""What a wrapper keeps for its calls, not as its state.

A copy of a wrapper (``copy.deepcopy``, pickling, ``torch.save``) or a replica of one (a wrapper
nested in a replicated module) starts without its lock, replicas, kept plans and per-call
records, and makes its own: no two objects ever share a lock or a set of replicas, and nothing
unpicklable (a thread-local, a lock, a weak reference) is pickled. :class:`CallState` is that
rule, a base of ``DataParallel``.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import nn

from dataparallel.scatter import PlanCache
from dataparallel.wrapper._signature import SLOT

__all__: list[str] = []

# The per-call state, by attribute name (each made lazily by the code that uses it).
RUNTIME = (
    "_calls",
    "_lock",
    "_replica_sets",
    "_sentinels",
    "_plans",
    "_here",
    "_compiled_replicas",
    "_sync_layers",
    "_one_device",
)


class CallState:
    """The wrapper's copy, pickle and replica rules for its per-call state (``RUNTIME``)."""

    __dict__: dict[str, Any]

    # What a replica of a module holding this wrapper does not copy (its
    # ``_replicate_for_data_parallel`` drops it): replicate's search of the tree skips it too.
    _not_replicated = frozenset(RUNTIME)

    def _replicate_for_data_parallel(self) -> Any:
        """A copy of this wrapper for a replica of a module that holds it (a nested wrapper):
        with no lock, replicas or plans of this one's; its calls run on the replica's own
        device (``_placement.run_here``)."""
        replica = nn.DataParallel._replicate_for_data_parallel(self)  # type: ignore[arg-type]
        for name in RUNTIME:
            replica.__dict__.pop(name, None)
        replica.__dict__["check_mode"] = None  # the outer wrapper's check= covers its calls
        return replica

    def __getstate__(self) -> dict[str, Any]:
        # Thread-locals, locks and weak references cannot be pickled or deep-copied: the copy
        # starts with no last call, lock, replicas, sentinels or kept plans (made again).
        state = self.__dict__.copy()
        for name in RUNTIME:
            state.pop(name, None)
        state.pop(SLOT, None)  # holds a weak reference to this wrapper: the copy makes its own
        return state

    def _call_lock(self) -> threading.RLock:
        """The lock that runs this wrapper's calls one at a time (see ``forward``)."""
        lock = self.__dict__.get("_lock")
        if lock is None:  # made lazily: a copied or unpickled wrapper has none
            lock = self.__dict__.setdefault("_lock", threading.RLock())
        return lock

    def _plan_cache(self) -> PlanCache:
        """The kept plans (``PlanCache.find``), made lazily: a copied or unpickled wrapper has
        none."""
        plans = self.__dict__["_plans"] = PlanCache()
        return plans
