"""``nn.SyncBatchNorm`` synchronised across the replicas of one call: which layers, and when.

Plain BatchNorm in a data-parallel call normalises each chunk with that chunk's statistics, so
outputs, gradients and running statistics differ from one device's. torch's answer is DDP and
``nn.SyncBatchNorm``, whose forward synchronises over a ``torch.distributed`` process group
and, with none initialised, falls back to ``F.batch_norm`` on its own input. Here the replicas
of one call are threads of one process, so the layers can meet without a process group:

- the wrapper finds the ``SyncBatchNorm`` layers once per replica set (:class:`SyncLayers`) and,
  for a call with two or more replicas and a layer in training mode, makes a
  :class:`~dataparallel.parallel_apply._rendezvous.SyncCall` (:func:`sync_call`): a rendezvous
  the replicas meet at, one slot per layer use. How they meet, combine their statistics and
  never hang is :mod:`dataparallel.parallel_apply._rendezvous`'s job;
- ``explain`` says which BatchNorm layers are synchronised and which act per chunk
  (:func:`batchnorm_note`).

Under an initialised process group (DDP), torch's own ``SyncBatchNorm`` path runs and nothing
here intervenes.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dataparallel.parallel_apply._rendezvous import SyncCall

__all__ = ["SyncLayers", "batchnorm_note", "sync_call", "sync_layer_names"]


def sync_layer_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(synchronised, per_chunk)``: the qualified names of the ``nn.SyncBatchNorm`` layers
    and of the other BatchNorm layers (``BatchNorm1d/2d/3d``, lazy ones) in ``module``."""
    synced: list[str] = []
    per_chunk: list[str] = []
    for name, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm):
            synced.append(name or "(the module itself)")
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            per_chunk.append(name or "(the module itself)")
    return synced, per_chunk


def _names(names: list[str], at_most: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:at_most])
    return shown + (f" and {len(names) - at_most} more" if len(names) > at_most else "")


def batchnorm_note(module: nn.Module, waves: list[list[int]]) -> str:
    """What ``explain`` says about the module's BatchNorm layers for a plan with these waves
    (empty when it has none)."""
    synced, per_chunk = sync_layer_names(module)
    if not synced and not per_chunk:
        return ""
    replicas = max((len(w) for w in waves), default=1)
    if replicas < 2:
        return (
            "BatchNorm: one replica per wave, so every BatchNorm layer sees the wave's whole "
            "batch, as on one device"
        )
    parts = []
    if synced:
        scope = "the batch (every replica's chunk)"
        if len(waves) > 1:  # each wave is a contiguous slice of the batch: say which
            ends = [sum(sum(w) for w in waves[: i + 1]) for i in range(len(waves))]
            ranges = ", ".join(
                f"{start}-{end - 1}" for start, end in zip([0, *ends[:-1]], ends, strict=True)
            )
            scope = f"each wave (every replica's chunk of it; the waves hold samples {ranges})"
        parts.append(
            f"{len(synced)} SyncBatchNorm layer(s) ({_names(synced)}) are synchronised over "
            f"the replicas: in training mode they normalise with the statistics of {scope} "
            f"and update their running statistics once per call"
            + (", from the first wave" if len(waves) > 1 else "")
        )
    if per_chunk:
        first = "the first wave's replica 0 chunk" if len(waves) > 1 else "replica 0's chunk"
        parts.append(
            f"{len(per_chunk)} BatchNorm layer(s) ({_names(per_chunk)}) normalise each chunk "
            f"with its own statistics, as in torch.nn.DataParallel (running statistics from "
            f"{first}); nn.SyncBatchNorm.convert_sync_batchnorm(model) makes them "
            f"use the whole batch's"
        )
    return "BatchNorm: " + "; ".join(parts)


class SyncLayers:
    """The ``SyncBatchNorm`` layers of one replica set: for each replica, layer object id to
    the layer's index in preorder (the same index on every replica). Built once per set of
    replica objects (a rebuilt set has new objects), kept by the wrapper.

    Everything is held weakly: a replica set the wrapper drops (its module's structure
    changed) is freed with the tensors it holds. While a root lives, its tree, and so every id
    in ``index``, lives too.
    """

    __slots__ = ("index", "layers", "names", "roots", "warned")

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        self.roots = tuple(weakref.ref(r) for r in replicas)
        self.index: list[dict[int, int]] = []
        self.layers: list[weakref.ref[nn.Module]] = []  # replica 0's, for the training check
        self.names: list[str] = []
        for j, root in enumerate(replicas):
            found = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.SyncBatchNorm)]
            self.index.append({id(m): k for k, (_, m) in enumerate(found)})
            if j == 0:
                self.layers = [weakref.ref(m) for _, m in found]
                self.names = [n or "(the module itself)" for n, _ in found]
        self.warned = False

    def matches(self, replicas: Sequence[nn.Module]) -> bool:
        """Whether these are the replica objects this table was built for."""
        roots = self.roots
        return len(roots) == len(replicas) and all(
            map(operator.is_, [ref() for ref in roots], replicas)
        )

    def call(self, devices: Sequence[torch.device]) -> SyncCall | None:
        """A rendezvous for one call, or ``None`` when no layer is in training mode (eval mode
        uses the running statistics: nothing to synchronise) or there is one replica."""
        if len(self.roots) < 2:
            return None
        if not any(layer is not None and layer.training for layer in (r() for r in self.layers)):
            return None
        return SyncCall(self, list(devices))


def sync_call(
    state: dict[str, Any], replicas: list[nn.Module], devices: list[torch.device]
) -> SyncCall | None:
    """A wave's rendezvous, or ``None`` when the module has no ``SyncBatchNorm`` in training
    mode. ``state`` is the wrapper's ``__dict__``: it keeps the tables of the last two replica
    sets (a full wave and a shorter last one), found once per set (held weakly), so a call
    costs one identity check per replica and one flag per layer."""
    tables: list[SyncLayers] = state.get("_sync_layers") or []
    for table in tables:
        if table.matches(replicas):
            break
    else:  # newest first
        table = SyncLayers(replicas)
        state["_sync_layers"] = [table, *tables[:1]]
    return table.call(devices) if table.layers else None
