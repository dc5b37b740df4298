"""``load_unwrapped``: a checkpoint written through a wrapper, loaded into the plain model.

A trainer handed ``dp.DataParallel(model)`` saves the wrapper's ``state_dict``, whose keys are
``module.*`` (torch's DataParallel's, kept on purpose: its checkpoints load both ways):
transformers' ``Trainer.save_model`` and its ``checkpoint-N`` folders, Lightning's checkpoints
(``state_dict`` keys ``<attribute>.module.*``), ``fabric.save(path, {"model": wrapper})``.
``from_pretrained`` and ``load_state_dict`` on the plain model do not match those keys, and
``from_pretrained`` then initialises every weight afresh with a log line, not an error. This
module reads such a checkpoint, finds the prefix that ends in ``module.``, and loads the rest
into the plain model strictly: a key that is still missing is an error, never a silent
re-initialisation. A tied weight that ``save_pretrained`` wrote once (GPT-2's ``lm_head.weight``)
is restored through the model's ties, as ``from_pretrained`` restores it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dataparallel._common.digest import digest_damage, zip_damage

__all__ = ["load_unwrapped"]

_SUFFIX = "module."
# Files a checkpoint folder may hold, in the order transformers' from_pretrained prefers them.
_FOLDER_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_unwrapped(
    source: str | os.PathLike[str] | Mapping[str, Any],
    model: nn.Module,
    *,
    key: str | None = None,
    strict: bool = True,
) -> nn.Module:
    """Load a checkpoint written through a wrapper (keys ``module.*``) into the plain ``model``.

    Args:
        source: a state dict or a checkpoint dict; or a path: a folder written by
            ``Trainer.save_model`` or ``save_pretrained`` (``model.safetensors``, sharded or
            not, or ``pytorch_model.bin``), a ``.safetensors`` file, or a file ``torch.save``
            wrote (Lightning's ``.ckpt``, ``fabric.save``'s), read with
            ``weights_only=True``, after its records are checked against the CRC-32s the
            file holds (and a ``dataparallel train`` checkpoint against the SHA-256 of its
            contents written with it).
        model: the plain module to load into (not the wrapper).
        key: where the state dict sits in a checkpoint dict; by default the dict itself when
            its values are tensors, else its ``"state_dict"`` (Lightning) or ``"model"``
            (Fabric's usual name) entry.
        strict: as ``load_state_dict``'s: every key of ``model`` must be found (a key tied in
            ``model`` to one that is found, such as GPT-2's ``lm_head.weight``, is found
            through the tie, as ``from_pretrained`` does), and every key under the prefix must
            be one of ``model``'s. Keys outside the prefix (a Lightning
            module's other attributes) are not ``model``'s and are left alone.

    Returns:
        ``model``, loaded.

    Raises:
        ValueError: no state dict in the checkpoint, no prefix whose keys are ``model``'s, or
            a damaged file (a record or the contents no longer match their checksum).
        RuntimeError: ``load_state_dict``'s, for keys missing or unexpected under ``strict``.

    Example:
        >>> import torch, dataparallel as dp
        >>> wrapper = dp.DataParallel(torch.nn.Linear(2, 1), ["cpu", "cpu"])
        >>> plain = dp.load_unwrapped(wrapper.state_dict(), torch.nn.Linear(2, 1))
        >>> torch.equal(plain.weight, wrapper.module.weight)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model: expected the plain nn.Module to load into, got {type(model).__name__}"
        )
    from dataparallel.wrapper import DataParallel  # (the wrapper imports much; only here)

    if isinstance(model, DataParallel):
        raise TypeError(
            "model: expected the plain module, got a dp.DataParallel; its own state_dict keys "
            "are module.*, so load the checkpoint with wrapper.load_state_dict(...), or pass "
            "wrapper.module here"
        )
    found = source if isinstance(source, Mapping) else _read(Path(source))
    state = _state_dict(found, key)
    prefix = _prefix(state, model)
    plain = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    model.load_state_dict(_tied(plain, model), strict=strict)
    return model


def _tied(plain: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``plain`` with the keys it lacks that are tied in ``model`` to a key it holds (GPT-2's
    ``lm_head.weight``, one tensor with ``transformer.wte.weight``) filled from that key.

    ``save_pretrained`` (and so Trainer's checkpoints) writes a tied tensor once, and
    ``from_pretrained`` restores the other names through the model's ties; this does the same
    from the ties the model has (its names for one tensor), so any other missing key is still
    ``load_state_dict``'s error under ``strict``."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    filled = dict(plain)
    for group in names.values():
        if len(group) < 2:
            continue
        present = [n for n in group if n in plain]
        for name in group:
            if name not in filled and present:
                filled[name] = plain[present[0]]
    return filled


def _read(path: Path) -> Mapping[str, Any]:
    """The checkpoint at ``path``: a folder's weights file(s), or one file."""
    if path.is_dir():
        for name in _FOLDER_FILES:
            if (path / name).exists():
                return _read(path / name)
        files = sorted(p.name for p in path.iterdir())[:12]
        raise ValueError(
            f"source: expected a checkpoint folder holding one of {list(_FOLDER_FILES)}, found "
            f"{files} in {str(path)!r}; pass the weights file itself"
        )
    if not path.exists():
        raise FileNotFoundError(f"source: {str(path)!r} does not exist")
    if path.name.endswith(".index.json"):
        index = json.loads(path.read_text())
        merged: dict[str, Any] = {}
        for shard in sorted(set(index.get("weight_map", {}).values())):
            merged.update(_read(path.parent / shard))
        return merged
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ImportError(
                f"source: {str(path)!r} is a safetensors file and safetensors is not "
                f"installed; pip install safetensors"
            ) from exc
        return load_file(str(path))
    damage = zip_damage(path)
    if damage is not None:
        raise ValueError(_damaged(path, damage))
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickled objects that weights_only refuses
        raise ValueError(
            f"source: {str(path)!r} holds objects torch.load(weights_only=True) refuses "
            f"({type(exc).__name__}); if you trust the file, load it yourself, "
            f"torch.load(path, weights_only=False), and pass the dict"
        ) from exc
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"source: expected {str(path)!r} to hold a dict, found {type(loaded).__name__}"
        )
    damage = digest_damage(loaded)
    if damage is not None:
        raise ValueError(_damaged(path, damage))
    return loaded


def _damaged(path: Path, damage: str) -> str:
    return (
        f"source: expected {str(path)!r} as it was written, found it damaged ({damage}); "
        f"nothing was loaded from it; load a copy you trust"
    )


def _state_dict(found: Mapping[str, Any], key: str | None) -> Mapping[str, Any]:
    """The state dict inside a checkpoint dict (see ``load_unwrapped``'s ``key``)."""
    if key is not None:
        if key not in found:
            raise ValueError(
                f"key: {key!r} is not in the checkpoint, whose keys are {list(found)[:12]}"
            )
        found = found[key]
    elif found and not all(isinstance(v, torch.Tensor) for v in found.values()):
        for name in ("state_dict", "model"):
            if isinstance(found.get(name), Mapping):
                found = found[name]
                break
        else:
            raise ValueError(
                f"source: expected a state dict, or a checkpoint with a 'state_dict' or 'model' "
                f"entry, got a dict with keys {list(found)[:12]}; pass key= to name the entry"
            )
    if not isinstance(found, Mapping):
        raise ValueError(f"key: expected {key!r} to hold a state dict, got {type(found).__name__}")
    return found


def _prefix(state: Mapping[str, Any], model: nn.Module) -> str:
    """The prefix ending in ``module.`` (or none) under which ``state`` holds ``model``'s keys:
    the one that matches the most of them, the shortest on a tie."""
    wanted = set(model.state_dict())
    candidates = {""}
    for k in state:
        at = k.find(_SUFFIX)
        while at >= 0:
            if at == 0 or k[at - 1] == ".":  # a whole name: "module.", "model.module."
                candidates.add(k[: at + len(_SUFFIX)])
            at = k.find(_SUFFIX, at + 1)
    scored = [
        (sum(k.startswith(p) and k[len(p) :] in wanted for k in state), -len(p), p)
        for p in candidates
    ]
    best, _, prefix = max(scored)
    if best == 0:
        sample = sorted(state)[:3]
        raise ValueError(
            f"source: none of its keys ({sample}, ...) are {type(model).__name__}'s (such as "
            f"{sorted(wanted)[:2]}), with or without a prefix ending in 'module.'; expected a "
            f"checkpoint of this model, written through a wrapper or not"
        )
    return prefix
