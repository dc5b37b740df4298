"""Whether a checkpoint file is still what was written: its checksums, checked before use.

``torch.load`` reads a damaged file without a word when the damage falls inside a tensor's
bytes (a zeroed block, flipped bits): the zip's own CRC-32 of each record is written and never
checked. Two checks here, both before any weight is used:

- :func:`zip_damage`: every record of a ``torch.save`` zip against the CRC-32 written with it
  (every such file has them, checkpoints written before this check included);
- :func:`digest_damage`: a checkpoint dict against the SHA-256 of its contents that
  :func:`with_digest` wrote into it (``"checksum"``); a dict without one is not checked.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DIGEST_KEY", "content_digest", "digest_damage", "with_digest", "zip_damage"]

#: Where a checkpoint dict holds the checksum of the rest of its contents.
DIGEST_KEY = "checksum"
_PREFIX = "sha256:"


def _feed(h: Any, obj: Any) -> None:
    """Hash ``obj`` into ``h``: tensors by dtype, shape and bytes; containers in order."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)}:".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}:".encode())
        for value in obj:
            _feed(h, value)
    else:
        h.update(f"{type(obj).__name__}={obj!r};".encode())


def content_digest(state: Mapping[str, Any]) -> str:
    """The SHA-256 of ``state``'s contents (its ``"checksum"`` entry left out)."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != DIGEST_KEY})
    return _PREFIX + h.hexdigest()


def with_digest(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with the checksum of its contents under :data:`DIGEST_KEY`."""
    return {**state, DIGEST_KEY: content_digest(state)}


def digest_damage(state: Any) -> str | None:
    """What is wrong with a checkpoint dict whose contents no longer match its checksum, or
    ``None`` (it matches, or it carries none)."""
    if not isinstance(state, Mapping):
        return None
    written = state.get(DIGEST_KEY)
    if not isinstance(written, str) or not written.startswith(_PREFIX):
        return None
    if content_digest(state) == written:
        return None
    return "its contents do not match the SHA-256 checksum written with them"


def zip_damage(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the records of a ``torch.save`` zip at ``path``, or ``None`` (each
    matches the CRC-32 written with it, or the file is no zip: torch's legacy format, or not a
    torch file at all, which ``torch.load`` then refuses)."""
    try:
        if not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as exc:
        reason = str(exc).strip() or type(exc).__name__
        return f"its zip structure is damaged ({reason})"
    except Exception as exc:  # (zlib.error and the like, from a damaged compressed record)
        return f"its zip structure is damaged ({type(exc).__name__}: {exc})"
    if bad is not None:
        return f"its record {bad!r} does not match the CRC-32 checksum written with it"
    return None
