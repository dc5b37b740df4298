"""Where a replica's scalar output came from, when it is not a value the replica computed.

A 0-dim tensor that every replica returns unchanged is one value, not one per chunk: a buffer
(``return y, self.step``) or an input passed through (``return y, k``). On the module's own
device it is the same object on every replica, but a replica on another device (``cpu:1``,
``cuda:1``) holds a copy, and a cast makes one too, so identity alone cannot say it. What made
the copies can: ``replicate`` gives every replica the module's buffers and parameters under
the same names, and ``scatter`` gives every chunk the broadcast inputs at the same program step.
:class:`Origins` answers "are these the copies of one value?" from that, and only when gather
asks (integer and boolean scalars equal on every replica), so a call pays one small object.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dataparallel._common.kinds import struct_items
from dataparallel._common.tree import TooDeep, leaves
from dataparallel.plan import BroadcastCut, Program, Rebuild, Step

__all__: list[str] = []

# Where replica 0 keeps its 0-dim buffers and parameters, by replica set (weakly held, so
# replicas the user drops are freed).
_SCALAR_PLACES: weakref.WeakKeyDictionary[nn.Module, list[tuple[dict[str, Any], str, str]]] = (
    weakref.WeakKeyDictionary()
)


class Origins:
    """What one call's replicas were given: each output's replica (for its buffers and
    parameters, by name), and, when the built-in scatter made the chunks, the plan's program
    and each chunk's arguments (for its broadcast inputs)."""

    __slots__ = ("_inputs", "args", "kwargs", "program", "replicas")

    def __init__(
        self,
        replicas: Sequence[nn.Module],
        program: Program | None,
        args: Sequence[Any],
        kwargs: Sequence[Any],
    ) -> None:
        self.replicas = replicas
        self.program, self.args, self.kwargs = program, args, kwargs
        self._inputs: list[dict[int, tuple[int, int]]] | None = None

    def one_value(self, values: Sequence[Any]) -> bool:
        """Whether ``values`` (one tensor per replica, in order) are one buffer, parameter or
        broadcast input as each replica received it: the copies of one value."""
        if len(values) != len(self.replicas):
            return False
        return self._same_tensor(values) or self._same_input(values)

    # -- buffers and parameters, by name ------------------------------------------------------

    def _same_tensor(self, values: Sequence[Any]) -> bool:
        # Found once per replica set: its last replica is rebuilt when the module's structure
        # changes (a buffer registered), so what is kept with it is never stale.
        key = self.replicas[-1]
        places = _SCALAR_PLACES.get(key)
        if places is None:
            places = _SCALAR_PLACES[key] = _scalar_places(self.replicas[0])
        first = values[0]
        for table, last, name in places:
            if table.get(last) is first:  # replica 0's buffer or parameter, read now
                return all(
                    _tensor_at(r, name) is v for r, v in zip(self.replicas, values, strict=True)
                )
        return False

    # -- broadcast inputs, by program step --------------------------------------------------

    def _same_input(self, values: Sequence[Any]) -> bool:
        if self.program is None or len(self.args) != len(values):
            return False
        if self._inputs is None:
            self._inputs = [
                _broadcast_scalars(self.program, a, k)
                for a, k in zip(self.args, self.kwargs, strict=True)
            ]
        keys = [table.get(id(v)) for table, v in zip(self._inputs, values, strict=True)]
        return keys[0] is not None and all(k == keys[0] for k in keys)


def _scalar_places(module: nn.Module) -> list[tuple[dict[str, Any], str, str]]:
    """``(table, key, name)`` of each 0-dim buffer and parameter: the submodule's own
    ``_buffers`` or ``_parameters`` dict (never the module, which must stay free to be
    dropped), so a call reads each with one ``dict.get``, even after it was replaced."""
    places: list[tuple[dict[str, Any], str, str]] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for table in (sub._buffers, sub._parameters):
            for key, tensor in table.items():
                if tensor is not None and tensor.ndim == 0:
                    places.append((table, key, f"{prefix}.{key}" if prefix else key))
    return places


def _tensor_at(module: nn.Module, name: str) -> Any:
    """The buffer or parameter ``name`` (``"block.bn.num_batches_tracked"``) of ``module`` or of
    a replica of it (whose parameters are plain attributes, as torch's replicas' are)."""
    *parents, last = name.split(".")
    for part in parents:
        module = module._modules.get(part)  # type: ignore[assignment]
        if module is None:
            return None
    found = module._buffers.get(last)
    if found is None:
        found = module._parameters.get(last)
    if found is None:
        found = module.__dict__.get(last)
    return found


def _broadcast_scalars(program: Program, args: Any, kwargs: Any) -> dict[int, tuple[int, int]]:
    """``id`` of every 0-dim tensor a chunk received by broadcast -> (its step, its place)."""
    table: dict[int, tuple[int, int]] = {}
    try:
        _walk(program.args, args, table)
        for key, step in zip(program.kw_keys, program.kw_steps, strict=True):
            if isinstance(kwargs, dict) and key in kwargs:
                _walk(step, kwargs[key], table)
    except (TooDeep, TypeError, ValueError):  # a chunk that is not the program's shape
        pass
    return table


def _walk(step: Step, obj: Any, table: dict[int, tuple[int, int]]) -> None:
    if isinstance(step, Rebuild):
        values = struct_items(obj, step.kind)[1]
        for child, value in zip(step.children, values, strict=True):
            _walk(child, value, table)
    elif isinstance(step, BroadcastCut):
        for place, leaf in enumerate(leaves(obj)):
            if isinstance(leaf, torch.Tensor) and leaf.ndim == 0:
                table[id(leaf)] = (id(step), place)
