"""``torch.compile`` and DataParallel: ``compile=``, and clear answers for the other orders.

``dp.DataParallel(model, devices, compile=True)`` (or ``compile={torch.compile kwargs}``)
compiles every replica's forward, replica 0 (the module itself) included: the wrapper compiles
one function that calls a replica given as its argument (``CompiledReplicas``), so the copies
share one graph and a warm wrapper compiles nothing per call. The user's module is not changed.

The other orders do not work, and say so:

- ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``forward`` is a compiled
  function bound to the original ``model``; ``model.compile()`` stores one bound the same way.
  A replica copies that binding, so every replica would run the original module: on one device
  all of them would write its buffers at once, on other devices its parameters would be in the
  wrong place. So ``DataParallel`` refuses such a module on more than one replica, at once.
- ``torch.compile(dp.DataParallel(model))`` traces the wrapper's pipeline, which dynamo cannot
  compile (locks, threads): it used to graph-break into a few tiny graphs and run every layer
  eagerly. The wrapper's forward now runs outside dynamo when traced, and warns once with the
  fix, ``compile=``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dataparallel._common.warn import warn_user
from dataparallel.replicate._rebind import HOOKS_SEEN

__all__ = [
    "CompiledReplica",
    "CompiledReplicas",
    "check_compile_option",
    "check_not_compiled",
    "compiled_class",
    "eager_message",
    "warn_compiled_wrapper",
]


def compiled_class() -> type | None:
    """``torch.compile``'s module wrapper class (``OptimizedModule``), where torch has one.

    ``None`` while dynamo is not imported: then nothing can have been compiled, and importing
    it here (about a second) would only find that out.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def check_not_compiled(module: nn.Module, devices: Sequence[torch.device]) -> None:
    """Raise when ``module`` was compiled as a whole and would be replicated.

    Raises:
        TypeError: ``module`` is a ``torch.compile`` result, or was compiled in place with
            ``module.compile()``, and ``devices`` holds more than one replica.
    """
    if len(devices) < 2:
        return  # one replica is the module itself: its compiled forward is right
    compiled = compiled_class()
    if compiled is not None and isinstance(module, compiled):
        found = "a torch.compile(...) result (OptimizedModule)"
    elif module.__dict__.get("_compiled_call_impl") is not None:
        found = "a module compiled in place with module.compile()"
    else:
        return
    raise TypeError(
        f"module: expected an eager module to replicate over {len(devices)} replicas, got "
        f"{found}: its compiled forward is bound to the original module, so every replica "
        f"would run that one module (racing on its buffers, or on the wrong device); fix: "
        f"compile the wrapper instead: pass the eager model with compile=True, "
        f"dp.DataParallel(model, devices, compile=True) (for a torch.compile result, its "
        f"eager model is model._orig_mod)"
    )


def check_compile_option(value: Any) -> dict[str, Any] | None:
    """``compile=`` as ``torch.compile`` keyword arguments (``True``: none), or ``None`` for
    ``False``; a TypeError naming what to pass otherwise."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        options = dict(value)
        try:  # torch.compile checks its arguments (the backend's name) when called: now
            torch.compile(nn.Identity(), **options)
        except Exception as exc:
            raise type(exc)(
                f"compile: torch.compile refused {options!r}: {exc}; pass keyword arguments "
                f"of torch.compile, e.g. {{'backend': 'inductor', 'mode': 'reduce-overhead'}}"
            ) from exc
        return options
    raise TypeError(
        f"compile: expected True, False or a dict of torch.compile keyword arguments, got "
        f"{type(value).__name__} {value!r:.60}; pass e.g. compile=True or "
        f"compile={{'backend': 'inductor', 'mode': 'max-autotune'}}"
    )


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What each wrapper compiles: one replica's call, the replica an argument."""
    return module(*args, **kwargs)


class CompiledReplica(nn.Module):
    """One replica run through its wrapper's compiled call (an ``nn.Module``, so the pool runs
    it as it runs a replica; the replica is its child, so its parameters are found)."""

    def __init__(self, replica: nn.Module, call: Any) -> None:
        super().__init__()
        self.replica = replica
        self.__dict__["_run"] = (call, replica)  # read without nn.Module's __getattr__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call, replica = self.__dict__["_run"]
        return call(replica, *args, **kwargs)


class CompiledReplicas:
    """A wrapper's compiled call, and each replica's ``CompiledReplica``, kept while in use.

    One ``torch.compile`` per wrapper, the replica an argument: replicas of one layout (the
    copies on other devices) share one graph, replica 0 (the module itself, whose parameters
    are registered differently) has its own, and a warm wrapper compiles nothing per call.
    dynamo keeps graphs, and its limit on recompilations, per code object: each table
    compiles a code object of its own, so wrappers do not share that budget. Replicas are
    reused while the module's structure holds; a set rebuilt after a change gets new entries,
    and the table then forgets replicas no longer in use.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.source = options  # the wrapper's dict, to tell when it is replaced
        self.options = dict(options)
        self.hooks: list[Any] = []  # the hooks the call was compiled for (identities)
        self.global_hooks = _global_hooks()  # and the global forward hooks
        self._table: dict[int, tuple[nn.Module, nn.Module]] = {}  # id -> (replica, wrapped)
        self.call = self._compile()

    def _compile(self) -> Any:
        code = _call.__code__.replace()  # a copy: a code object of this table's own
        own = types.FunctionType(code, _call.__globals__, "compiled_replica_call")
        return torch.compile(own, **self.options)

    @classmethod
    def of(cls, wrapper: Any, options: dict[str, Any]) -> CompiledReplicas:
        """The wrapper's table for these options (made again if they were replaced); only the
        wrapper's ``__dict__`` is read and written."""
        table: CompiledReplicas | None = wrapper.__dict__.get("_compiled_replicas")
        if table is None or table.source is not options:
            table = wrapper.__dict__["_compiled_replicas"] = cls(options)
        return table

    def wrap(self, replicas: Sequence[nn.Module]) -> list[nn.Module]:
        """Each replica as a module that runs it through the compiled call, in order.

        dynamo does not guard on module hooks: after a forward hook or pre-hook of the tree was
        added, removed or swapped (the replica set keeps the hooks it saw at its last fill), the
        call is compiled again, so no replica runs a stale graph. The lists are compared only
        when a set holds a new one (after a refill, or in another set), and on every call of
        one replica, the module itself (``compile=`` on a one-device list)."""
        # One replica is the module itself, which no set refills: its hooks are read here.
        hooks = replicas[-1].__dict__.get(HOOKS_SEEN, []) if len(replicas) > 1 else []
        if len(replicas) == 1:
            hooks = [
                tuple(map(id, table.values()))
                for m in replicas[0].modules()
                for table in (m._forward_hooks, m._forward_pre_hooks)
            ]
        glob = _global_hooks()  # (``register_module_forward_hook``: no module is written)
        if hooks is not self.hooks or glob != self.global_hooks:
            if hooks != self.hooks or glob != self.global_hooks:
                self._table.clear()
                self.call = self._compile()
            self.hooks, self.global_hooks = hooks, glob
        table = self._table
        out = []
        for replica in replicas:
            entry = table.get(id(replica))
            if entry is None or entry[0] is not replica:
                entry = table[id(replica)] = (replica, CompiledReplica(replica, self.call))
                if len(table) > 4 * len(replicas) + 8:  # old sets: keep only this call's
                    keep = {id(r) for r in replicas}
                    for key in [k for k in table if k not in keep]:
                        del table[key]
            out.append(entry[1])
        return out


def _global_hooks() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global forward hooks and pre-hooks now (identities): dynamo does not guard on
    them either, so a compiled call made before one was registered would never run it."""
    from torch.nn.modules import module as torch_module

    return (
        tuple(map(id, torch_module._global_forward_hooks.values())),
        tuple(map(id, torch_module._global_forward_pre_hooks.values())),
    )


def warn_compiled_wrapper(wrapper: nn.Module) -> None:
    """Once per wrapper: ``torch.compile(wrapper)`` runs the wrapper eagerly, compiling none of
    the module; ``compile=`` is the way that does."""
    if wrapper.__dict__.get("_warned_compiled"):
        return
    wrapper.__dict__["_warned_compiled"] = True
    if wrapper.__dict__.get("compile_options") is not None:
        warn_user(
            "torch.compile(dp.DataParallel(..., compile=...)) adds nothing: the wrapper's "
            "scatter, threads and gather run eagerly, and its replicas are compiled by "
            "compile= already; drop the outer torch.compile"
        )
        return
    warn_user(
        "torch.compile(dp.DataParallel(...)) compiles none of the model: the wrapper's "
        "scatter, threads and gather cannot be traced, so it runs eagerly, and so would every "
        "replica; fix: let the wrapper compile each replica's forward, "
        "dp.DataParallel(model, devices, compile=True), or compile={'backend': ...} with "
        "torch.compile's keyword arguments"
    )


def eager_message(what: str, replicas: int) -> str:
    """The warning for a submodule compiled in place (``what``), replicated as its eager
    module on ``replicas`` replicas."""
    return (
        f"module: a compiled submodule ({what}) is replicated as its eager module: replica 0 "
        f"(the module itself) runs it compiled, replicas 1 to {replicas - 1} run "
        f"their own copies eagerly; to compile every replica, let the wrapper compile them: "
        f"dp.DataParallel(model, devices, compile=True)"
    )
