"""The express call: a warm call whose every gate is known to pass, because nothing any gate
read was written since the last one.

A warm call (``_warm``) still asks, on every call, what the general path asks: is the wrapper
hooked, traced, compiled in place, a copy in another wrapper's replica; which kept plan fits the
arguments; is a step overridden, a count passed, a gather rule set; are the replicas in line with
the module. Each answer is a function of a few dictionaries (the wrapper's ``__dict__`` and
tables, its options, torch's global hook tables, every table of the module tree, the module's
classes, the wrapper's replica sets) and of a few values that live in none (the argument's type,
shape and layout, the parameters' device, the replica set's refills, the wrapper's device list,
the tracing and compiling state).

An :class:`Express` keeps the answers of a warm call (its plan, step, replicas) with the write
stamps (``_common.stamps``) of all those dictionaries, read after the answers were and before
the replicas ran (a forward that writes to the module moves a stamp, as it should). The next
call of one positional tensor reads the stamps and the few values again; when nothing moved it
runs the warm call's own tail (``WarmStep.run``: the same cut, kept tasks and gather), under the
same lock. When anything moved it misses, the general path runs, and that warm call arms the
express again. A step whose express keeps missing (a forward that writes an attribute on every
call) stops arming it.

Only where stamps exist (CPython 3.11) and for the simplest warm call: one positional
plain tensor, a replica set that shares the module's parameters and holds no buffer copy, no
watched holder, no warning to give, immutable options.
"""

from __future__ import annotations

import gc
import operator
import weakref
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.modules.module as _torch_module
from torch import nn

from dataparallel._common.stamps import AVAILABLE, Stamps, stamps
from dataparallel.replicate import ReplicaSets
from dataparallel.wrapper._call import direct_call
from dataparallel.wrapper._placement import sentinels_hold, watched_tensors

if TYPE_CHECKING:
    from dataparallel.plan import Plan
    from dataparallel.wrapper._warm import WarmStep
    from dataparallel.wrapper._waves import Overrides, Wrapper

__all__ = ["MISS", "Express", "arm"]

MISS = object()  # ``Express.call``'s answer when the general path must run

_Tensor = torch.Tensor
_tracing = torch._C._get_tracing_state
_compiling = torch.compiler.is_compiling
_is = operator.is_
_IS_CPU = operator.attrgetter("is_cpu")
_DICT = operator.attrgetter("__dict__")
_GIVE_UP = 3  # arms in a row that served no call: the step stops arming
# The wrapper's own tables that torch's ``_call_impl`` and the pipeline read.
_TABLES = (
    "_modules",
    "_parameters",
    "_buffers",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


class Express:
    """One warm step's answers, valid while the stamps and the values it holds are unchanged."""

    __slots__ = (
        "__weakref__",
        "classes",
        "devices",
        "devices_now",
        "dicts",
        "entry",
        "fills",
        "held",
        "layout",
        "lock",
        "loose",
        "module",
        "modules",
        "plan",
        "replicas",
        "shape",
        "stamps",
        "state",
        "step",
        "steps",
        "watch",
    )

    def __init__(
        self,
        w: Wrapper,
        step: WarmStep,
        plan: Plan,
        module: nn.Module,
        x: torch.Tensor,
        entry: Any,
        replicas: list[nn.Module],
        steps: Overrides,
        stamps: Stamps,
    ) -> None:
        state = w.__dict__
        # The wrapper's dictionary (the express lives in it), by address: another wrapper, or
        # this one given a new ``__dict__``, is not served. Not held, so that no cycle keeps a
        # deleted wrapper's module and replicas alive until the collector runs; its stamp is
        # read only after this check found it alive at that address.
        self.state = id(state)
        self.step, self.plan, self.module, self.steps = step, plan, module, steps
        self.shape, self.layout = x.shape, x.layout
        self.entry, self.fills = entry, entry.fills
        # What the snapshot reads besides its tables' stamps (replaced only by a refill, which
        # moves ``fills``): the order of its tables that are not plain dictionaries. Its
        # storage addresses are not watched (a set that shares every parameter, no buffer).
        self.loose, self.held = entry.snapshot.loose
        # The tree's modules, their classes and dictionary objects (``__class__`` and
        # ``__dict__`` assignments write no table).
        rest, self.classes, self.dicts = entry.snapshot.objects
        self.modules = [module, *rest]
        self.replicas = replicas
        self.devices_now: list[torch.device] = w.device_ids  # the list, written in place or not
        self.devices = list(self.devices_now)
        # The module's first and last tensor (the device check's sentinels): the same objects
        # while the stamps hold; ``module.to()`` keeps the objects and moves their data.
        self.watch = watched_tensors(state["_sentinels"])
        self.lock = state["_lock"]
        self.stamps = stamps

    def call(self, w: Wrapper, x: Any) -> Any:
        """``w(x)`` when nothing changed since the express was armed, else :data:`MISS`."""
        if _compiling():  # first: under dynamo the general path runs (and nothing else is read)
            return MISS
        try:
            if type(x) is not _Tensor or x.shape != self.shape or x.layout is not self.layout:
                return MISS
        except RuntimeError:  # a nested tensor has no shape to read: the general path names it
            return MISS
        if (
            id(w.__dict__) != self.state
            or self.entry.fills != self.fills
            or not self.stamps.same()
            or list(map(type, self.modules)) != self.classes
            or not all(map(_is, map(_DICT, self.modules), self.dicts))
            or (self.loose and not all(map(_is, chain.from_iterable(self.loose), self.held)))
            or self.devices_now != self.devices
            or not all(map(_IS_CPU, self.watch))
            or _tracing()
        ):
            return MISS
        lock = self.lock
        if not lock.acquire(blocking=False):  # another thread's call, or a pool worker's
            return MISS
        try:
            step, plan = self.step, self.plan
            step.served += 1
            args, kws = step.cut(plan, (x,), {})
            return step.run(w, plan, self.module, self.replicas, args, kws, self.steps)
        finally:
            lock.release()


def arm(
    w: Wrapper,
    step: WarmStep,
    plan: Plan,
    module: nn.Module,
    x: torch.Tensor,
    sets: ReplicaSets,
    replicas: list[nn.Module],
    steps: Overrides,
) -> None:
    """Make ``step``'s express serve the next call, from a warm call whose gates just passed
    and whose replicas are about to run (``replicas``: in line with ``module`` now)."""
    kept = step.express() if isinstance(step.express, weakref.ref) else step.express
    if kept is False or not AVAILABLE:
        return
    state = w.__dict__
    entry = None if sets.shared or sets.module is not module else sets.sets.get(step.resolved)
    if entry is None or entry.snapshot is None or not _eligible(w, plan, entry):
        return
    if step.express is not None:  # armed before: did it serve a call since?
        step.misses = 0 if step.served else step.misses + 1
        if step.misses >= _GIVE_UP:
            step.express = False
            if isinstance(state.get("_express"), Express):
                state.pop("_express", None)
            return
    step.served = 0
    express: Express
    if kept is not None and (
        kept.entry is entry
        and kept.fills == entry.fills
        and kept.replicas == replicas
        and kept.plan is plan
        and kept.devices_now is w.device_ids
    ):
        express = kept  # what it holds is what this call found: armed again
    else:
        read = stamps(_tables(w, entry.snapshot.tables, module, sets), borrowed=1)
        if read is None:
            step.express = False
            return
        express = Express(w, step, plan, module, x, entry, replicas, steps, read)
        # Held by the wrapper's ``__dict__`` alone (the step keeps a weak reference): the
        # wrapper's deletion frees it, and its module and replicas, at once.
        step.express = weakref.ref(express)
    if state.get("_express") is not express:
        state["_express"] = express
    express.stamps.take()  # (after the write above: it is part of the wrapper's table)


def _eligible(w: Wrapper, plan: Plan, entry: Any) -> bool:
    """Whether every answer a warm call of ``plan`` gives is held by the express's stamps and
    values: reached without torch's ``_call_impl`` (no hook on the wrapper or global), immutable
    options, nothing to warn, a replica set with nothing to refresh."""
    state = w.__dict__
    plans = state.get("_plans")
    return (
        direct_call(state)  # (a call through torch's ``_call_impl`` runs the wrapper's hooks)
        and plans is not None
        and plans.values is not None  # options of immutable values only (none changed in place)
        and not plan.warnings
        and "_is_replica" not in state
        and sentinels_hold(state.get("_sentinels"), w.src_device_obj)
        and w.src_device_obj.type == "cpu"  # (the kept tasks serve CPU lists only)
        and not entry.snapshot.watches_storage
        and state.get("_lock") is not None
        and isinstance(state.get("options"), dict)
        and not entry.targets
        and not entry.buffers
        and not entry.rebinding.watched
    )


def _tables(
    w: Wrapper, tree: list[dict[str, Any]], module: nn.Module, sets: ReplicaSets
) -> list[dict[Any, Any]]:
    """Every dictionary an answer of the warm call reads: the wrapper's ``__dict__``, tables
    and options, torch's global hook tables (and the module that holds them), the replica
    sets' table, the module tree's tables, and the namespaces of the module's classes (where
    its ``forward``, whose signature places the count, is found) and of the wrapper's."""
    state = w.__dict__
    tables: list[dict[Any, Any]] = [state, state["options"], sets.sets]
    tables += [t for t in map(state.get, _TABLES) if isinstance(t, dict)]
    tables.append(vars(_torch_module))
    tables += [getattr(_torch_module, name) for name in _GLOBAL_HOOKS]
    tables += tree
    # (not ``object``'s; the wrapper's class too: a method patched on it is not skipped)
    for cls in (*type(module).__mro__[:-1], *type(w).__mro__[:-1]):
        tables += [d for d in gc.get_referents(cls.__dict__) if type(d) is dict]
    return tables
