"""How the replica search names what it found, in the warnings it gives: the hook tables a
replica rebinds and their kinds, a hook by its function's qualified name, and the two
warnings of :class:`._rebind.Rebinding` (a holder the replicas share that forward wrote; a
hook that makes a replica set run one replica at a time). Apart from the search, so the
words change without touching what is searched.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

from torch import nn

from dataparallel.replicate._kinds import MAX_DEPTH, MAX_VISITS
from dataparallel.replicate._reach import filled

__all__ = [
    "KINDS",
    "REBOUND_TABLES",
    "function_of",
    "hook_name",
    "qualname",
    "serial_message",
    "written_message",
]

# The hook tables whose hooks are rebound (each replica gets its own copy of a table that holds
# one). Load-state-dict hooks are left: loading into a replica is not something forward does.
REBOUND_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
)

# What a warning calls a function found in each table (or as an instance ``forward``).
KINDS = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "forward": "forward",
}


def qualname(obj: Any) -> str | None:
    """``obj.__qualname__`` where it has a text one, else ``None``: a user's ``__getattr__``
    may raise anything for a name it does not hold (a proxy's ``KeyError``), not only
    ``AttributeError``."""
    try:
        name = getattr(obj, "__qualname__", None)
    except Exception:  # (its own error for a name it does not hold)
        return None
    return name if isinstance(name, str) else None


def function_of(hook: Any) -> Any:
    """The function a hook runs: a ``functools.partial``'s and a bound method's own, at any
    depth; the hook itself otherwise."""
    for _ in range(MAX_DEPTH):
        inner = (
            hook.func if isinstance(hook, functools.partial) else getattr(hook, "__func__", None)
        )
        if inner is None:
            return hook
        hook = inner
    return hook


def hook_name(hook: Any) -> str:
    """A hook's name for a warning: its qualified name (a method's is ``Class.method``), a
    ``functools.partial`` by the function it wraps, else its class's name."""
    if isinstance(hook, functools.partial):
        return f"functools.partial({hook_name(hook.func)})"
    return qualname(hook) or type(hook).__name__


def written_message(
    root: nn.Module, index: int, obj: Any, replicas: int, held: list[Any] | None = None
) -> str:
    """The warning for ``obj``, a holder the replicas share that forward wrote, found from the
    module at preorder ``index`` of ``root``'s tree (named with the attribute or hook variable
    that holds it, where one does directly; a class's dictionary by the class, with the names
    written since it held ``held``, its keys then values)."""
    named = list(root.named_modules())  # (preorder, each module once: the set's indices)
    name, module = named[index] if index < len(named) else ("", root)
    where = f"module {name!r}" if name else "the module itself"
    how = f"an object {where} reaches"
    kind = type(obj).__name__
    if type(obj).__module__ in ("numpy", "itertools"):  # ("a numpy array", "a count of itertools")
        kind = "numpy array" if kind == "ndarray" else f"{kind} of {type(obj).__module__}"
    for cls in type(module).__mro__:
        if any(ref is obj for ref in gc.get_referents(cls.__dict__)[:1]):
            half = len(held or ()) // 2
            before = dict(zip((held or [])[:half], (held or [])[half:], strict=True))
            keys = [k for k, v in obj.items() if before.get(k, obj) is not v] if held else []
            names = ", ".join(f"{cls.__name__}.{k}" for k in keys) or "an attribute"
            how, kind = f"the class attribute {names} (of the class of {where})", "class"
    if obj is getattr(type(module), "forward", None):  # (a ``global`` its forward rebinds)
        how = f"a variable or attribute of the forward {qualname(obj)} of {where}"
    for key, value in module.__dict__.items():
        items = value.values() if type(value) is dict else value if type(value) is list else ()
        if any(item is obj for item in items):
            how = f"an item of the attribute {key!r} of {where}"
        if value is obj:
            how = f"the attribute {key!r} of {where}"
    for table in REBOUND_TABLES:
        for hook in (module.__dict__.get(table) or {}).values():
            func = function_of(hook)
            cells = getattr(func, "__closure__", None) or ()
            # (the hook's function itself: one of its own variables or attributes, a
            # ``nonlocal`` or ``global`` it rebinds, ``hook.calls += 1``; else a holder in
            # one of its variables)
            if func is obj or any(filled(cell) and cell.cell_contents is obj for cell in cells):
                hook_kind = KINDS.get(table, "hook")
                how = f"a variable or attribute of the {hook_kind} {hook_name(hook)} of {where}"
                kind = hook_kind if func is obj else kind  # (else what its variable holds)
    return (
        f"module: forward wrote {how}, a {kind} the {replicas} replicas share (it "
        f"leads to no module, so it is not copied for each): every replica that reaches it "
        f"wrote it, so a write one device makes once per forward (an append, a count) was made "
        f"up to {replicas} times in this call, each from its replica's chunk. To keep one write "
        f"per call, make it from the wrapper's output after the call, or keep the state in a "
        f"tensor buffer (written once per call, from replica 0's chunk)"
    )


def serial_message(reason: str, why: str) -> str:
    """The warning for a replica set that runs one replica at a time: ``reason`` names the
    hook, forward or attribute and its module; ``why`` is what the search met there
    (``"thread"``: a ``threading.local``; ``"limit"``: past the search's limits; else an
    object that cannot be rebound)."""
    if why == "thread":
        found = (
            "holds a threading.local, whose attributes each thread sees apart, so a "
            "replica on another thread would not see what your thread set there"
        )
        fix = (
            "To run them in parallel, keep that state in an attribute of the module "
            "(a plain value, or a buffer)"
        )
    elif why == "limit":
        found = (
            f"is too large to search for a way back to the module (past {MAX_VISITS:,} "
            f"objects or {MAX_DEPTH} levels), so it might run on your module from "
            f"every replica's thread at once"
        )
        fix = (
            "To run them in parallel, have it hold what it uses rather than a large "
            "structure that also leads to the module"
        )
    else:
        found = (
            "leads back to the module through an object that cannot be rebound to "
            "each replica, so it would run on your module from every replica's thread "
            "at once"
        )
        fix = (
            "To run them in parallel, make it a method of the module, or a function, "
            "closure or functools.partial over the module: those are rebound to each "
            "replica"
        )
    return (
        f"module: {reason} {found}; the replicas of this module run one after another "
        f"on the calling thread instead. {fix}"
    )
