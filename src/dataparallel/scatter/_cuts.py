"""One wave's chunks of a call of plain tensors, cut in one operation per tensor.

``take`` runs a plan's program once per chunk: for a call of two tensors on two devices that is
four walks of the program and four slices. Most training loops pass only plain tensors (the key
of their plans says so, ``_plans._plain_tensors``); for them ``WaveCut``, made once per kept
plan, cuts each split tensor into every chunk with one ``split_with_sizes`` (the same views
``take`` makes, at one dispatch per tensor instead of one per chunk) and gives a broadcast
tensor to every chunk as it is. Tensors are moved by the same movers as ``take``'s.

A plan whose program is anything else (a container, a marker, a cast, a sparse tensor) gets no
``WaveCut``: ``take`` serves it. A call whose split tensor is not the plan's batch long (a
signature that holds shapes makes that impossible, but the check costs one comparison) is cut
by ``take`` too, which names what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataparallel.plan import BroadcastCut, Plan, Rebuild, SplitCut, Step
from dataparallel.scatter._take import _mover, take

__all__ = ["WaveCut"]

_Tensor = torch.Tensor
_CPU = torch.device("cpu")  # equal only to device(type='cpu'), as a CPU tensor's device is


_OTHER = -(2**62)  # no dim: a step that ``WaveCut`` leaves to ``take``


def _dim_of(step: Step) -> int | None:
    """The dim a plain step splits along, ``None`` for a plain broadcast, ``_OTHER`` for any
    step ``WaveCut`` leaves to ``take``."""
    if type(step) is SplitCut and not step.cast and not step.unwrap:
        return step.dim
    if type(step) is BroadcastCut and not step.cast and not step.unwrap:
        return None
    return _OTHER


class WaveCut:
    """The chunks of the first wave of a kept plan whose arguments are all plain tensors."""

    __slots__ = (
        "arg_dims",
        "cpu",
        "devices",
        "kw_dims",
        "kw_keys",
        "movers",
        "no_kwargs",
        "one",
        "sizes",
        "total",
        "wave",
    )

    def __init__(
        self,
        wave: list[tuple[torch.device, int, int]],
        arg_dims: list[int | None],
        kw_keys: list[str],
        kw_dims: list[int | None],
    ) -> None:
        self.wave = wave
        self.devices = [device for device, _, _ in wave]
        self.sizes = [length for _, _, length in wave]
        self.total = sum(self.sizes)
        self.movers = [_mover(device, None) for device in self.devices]
        self.arg_dims, self.kw_keys, self.kw_dims = arg_dims, kw_keys, kw_dims
        # Every chunk on the CPU itself: a CPU tensor's chunks stay as they are (the movers
        # give back a tensor already on their device).
        self.cpu = all(device == _CPU for device in self.devices)
        # The most common call: one tensor, split, no keywords.
        self.one = arg_dims[0] if len(arg_dims) == 1 and not kw_keys else None
        self.no_kwargs: tuple[tuple[()], ...] = ((),) * len(wave)

    @classmethod
    def of(cls, plan: Plan, inputs: Any, kwargs: Mapping[str, Any]) -> WaveCut | None:
        """The cut for ``plan`` (kept for the signature of the call ``inputs``, ``kwargs``), or
        ``None`` when ``take`` must serve it: more than one wave, a cast, a program that is not
        plain tensors only."""
        program = plan.program
        if (
            program is None
            or len(plan.slices) != 1
            or plan.dtype is not None
            or not program.args_is_tuple
            or type(inputs) is not tuple
            or not isinstance(program.args, Rebuild)
        ):
            return None
        values = [*inputs, *(kwargs[k] for k in program.kw_keys)]
        if any(type(v) is not _Tensor or v.layout != torch.strided for v in values):
            return None
        wave = plan.slices[0]
        starts = [start for _, start, _ in wave]
        if starts != [sum(length for _, _, length in wave[:i]) for i in range(len(wave))]:
            return None  # chunks not in order from 0 (never made by the rules; kept safe)
        arg_dims = [_dim_of(step) for step in program.args.children]
        kw_dims = [_dim_of(step) for step in program.kw_steps]
        if _OTHER in arg_dims or _OTHER in kw_dims or len(arg_dims) != len(inputs):
            return None
        return cls(wave, arg_dims, list(program.kw_keys), kw_dims)

    def __call__(
        self, plan: Plan, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        """Each chunk's positional arguments (a tuple) and keyword arguments, in wave order.
        ``plan``: the kept plan (a template or bound), for ``take`` when a size is not the
        plan's."""
        dim = self.one
        if dim is not None:
            value = inputs[0]
            if value.shape[dim] == self.total:
                parts: Sequence[torch.Tensor] = value.split_with_sizes(self.sizes, dim)
                if not (self.cpu and value.is_cpu):
                    parts = list(map(_call, self.movers, parts))
                # Each chunk's 1-tuple and its own empty keywords, built in C (no frame per
                # list): ``self.no_kwargs`` holds one empty tuple per chunk, ``dict(())`` is {}.
                return list(zip(parts)), list(map(dict, self.no_kwargs))
        n = len(self.sizes)
        columns = self._columns(inputs, self.arg_dims)
        kw_columns = self._columns([kwargs[key] for key in self.kw_keys], self.kw_dims)
        if columns is None or kw_columns is None:  # a tensor not the plan's batch long
            return self._take(plan, inputs, kwargs)
        args = list(zip(*columns, strict=True)) if columns else [()] * n
        if not self.kw_keys:
            return args, [{} for _ in range(n)]
        keys = self.kw_keys
        return args, [dict(zip(keys, row, strict=True)) for row in zip(*kw_columns, strict=True)]

    def _columns(
        self, values: Sequence[torch.Tensor], dims: list[int | None]
    ) -> list[list[torch.Tensor]] | None:
        """Per value, its part for each chunk (the whole value where ``dim`` is ``None``);
        ``None`` when a split value is not the plan's batch long."""
        columns: list[list[torch.Tensor]] = []
        for value, dim in zip(values, dims, strict=True):
            if dim is None:
                columns.append([move(value) for move in self.movers])
            elif value.shape[dim] == self.total:
                parts = value.split_with_sizes(self.sizes, dim)
                columns.append(list(map(_call, self.movers, parts)))
            else:
                return None
        return columns

    def _take(
        self, plan: Plan, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        bound = plan.bind(inputs, kwargs)
        chunks = [take(bound, start, length, device) for device, start, length in self.wave]
        return [a for a, _ in chunks], [k for _, k in chunks]


def _call(move: Any, tensor: torch.Tensor) -> torch.Tensor:
    return move(tensor)
