"""The plan in words: the table ``explain`` prints, each leaf's row, and the broadcast warning
(batch rule 6): what was found, then the fixes.

Kept apart from ``_votes`` and ``_rules``, which decide, and ``_program``, which holds the
decision: this module only words it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from dataparallel._common.describe import describe
from dataparallel._common.kinds import ATOMS, container_kind, struct_items
from dataparallel.markers import Shared, Split


class Voted(Protocol):
    """A vote for the batch size, as this module reads it (``plan.Vote``)."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


class Planned(Protocol):
    """A plan, as this module reads it (``plan.Plan``; named here, not imported, so that the
    record and its wording do not import each other)."""

    batch_size: int
    devices: list[torch.device]
    votes: list[Any]
    waves: list[list[int]]
    decided_by: str
    dim: int
    warnings: list[str]
    notes: list[str]
    dtype: torch.dtype | None
    slices: list[list[tuple[torch.device, int, int]]]

    @property
    def entries(self) -> list[Any]: ...


__all__ = ["format_plan", "row_text", "voters_phrase", "warning_text"]

# Exact types that hold no tensor or ndarray.


def row_text(
    p: Planned, rule: str, value: Any, chunks: list[tuple[torch.device, int, int]]
) -> tuple[str, str, str]:
    """``(what, to, receives)`` of one leaf's row: what it is, where its tensors go and what
    each device gets."""
    return (describe(value), *_receives(p, rule, value, chunks))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _joined(parts: list[str]) -> str:
    """``"5"`` when every chunk has the same value, else one per chunk: ``"2/6/4/4"``."""
    return parts[0] if len(set(parts)) == 1 else "/".join(parts)


def _tensors_in(obj: Any) -> tuple[bool, bool]:
    """Whether ``obj`` holds a tensor, and a floating-point one, outside ``dp.Shared``."""
    if isinstance(obj, torch.Tensor):
        return True, obj.is_floating_point()
    if isinstance(obj, Shared):
        return _tensors_in(obj.obj)[0], False
    if isinstance(obj, Split):
        return _tensors_in(obj.obj)
    if type(obj) in ATOMS or isinstance(obj, (str, bytes, np.ndarray)):
        return False, False
    kind = container_kind(obj)
    if kind is None:
        return False, False
    found = floating = False
    for value in struct_items(obj, kind)[1]:
        has, has_float = _tensors_in(value)
        found, floating = found or has, floating or has_float
        if floating:
            break
    return found, floating


def _receives(
    p: Planned, rule: str, value: Any, chunks: list[tuple[torch.device, int, int]]
) -> tuple[str, str]:
    """``(to, receives)`` of one leaf: where its tensors go and what each device gets."""
    if not chunks:
        return "", ""
    devices = _joined([str(device) for device, _, _ in chunks])
    cast = p.dtype is not None and not isinstance(value, Shared)
    inner = value.obj if isinstance(value, (Shared, Split)) else value
    if rule == "split":
        dim = p.dim
        if isinstance(value, Split) and value.dim is not None:
            dim = value.dim
        if isinstance(inner, PackedSequence):  # split by sequence, re-packed on each device
            dtype = inner.data.dtype
            if cast and dtype.is_floating_point and p.dtype is not None:
                dtype = p.dtype
            counts = _joined([str(length) for _, _, length in chunks])
            return devices, f"PackedSequence of {counts} sequences, {_dtype_name(dtype)}"
        shape = [str(n) for n in inner.shape]
        shape[dim] = _joined([str(length) for _, _, length in chunks])
        if isinstance(inner, torch.Tensor):
            dtype = inner.dtype
            if cast and dtype.is_floating_point and p.dtype is not None:
                dtype = p.dtype
            return devices, f"Tensor[{', '.join(shape)}] {_dtype_name(dtype)}"
        return "not moved (ndarray)", f"ndarray[{', '.join(shape)}] {inner.dtype}"
    if rule == "per-sample":
        ranges = _joined(
            [
                str(start) if length == 1 else f"{start}-{start + length - 1}"
                for _, start, length in chunks
            ]
        )
        lengths = _joined([str(length) for _, _, length in chunks])
        kinds = describe(inner).partition(" of ")[2]
        text = f"{type(inner).__name__}[{lengths}] of {kinds}: items {ranges}"
        has, has_float = _tensors_in(inner)
        if not has:
            return "not moved (no tensor)", text
        if cast and p.dtype is not None and has_float:
            text += f", float tensors cast to {_dtype_name(p.dtype)}"
        return devices, text
    # broadcast: one whole copy per device
    if isinstance(inner, torch.Tensor):
        dtype = inner.dtype
        if cast and dtype.is_floating_point and p.dtype is not None:
            dtype = p.dtype
        dims = ", ".join(str(n) for n in inner.shape)
        text = f"the whole Tensor[{dims}] {_dtype_name(dtype)}"
        if isinstance(value, Shared) and p.dtype is not None and dtype.is_floating_point:
            text += " (dp.Shared: not cast)"
        return devices, text
    if isinstance(inner, np.ndarray):
        return "not moved (ndarray)", "the same ndarray"
    has, has_float = _tensors_in(inner)
    if has:
        text = f"the whole {describe(inner)}, tensors moved"
        if cast and p.dtype is not None and has_float:
            text += f", float ones cast to {_dtype_name(p.dtype)}"
        return devices, text
    return "not moved (no tensor)", "the same object"


def format_plan(p: Planned) -> str:
    """A readable table of a plan: batch size and votes, devices and chunks, one row per leaf,
    then what each device receives (after the cast, with the devices it moves to)."""
    if not p.entries:
        device = p.devices[0] if p.devices else "its device"
        return (
            f"nothing to split: the call passes no input (or only empty containers); the "
            f"module runs once, on {device}, as it would without DataParallel"
        )
    lines = [f"batch size {p.batch_size}, decided by {p.decided_by}"]
    if p.batch_size == 0:
        device = p.devices[0] if p.devices else "the first device"
        lines.append(
            f"an empty batch: the module runs once, on {device} (replica 0, on the caller's "
            f"thread), with the empty inputs, and its output is returned as it is, as without "
            f"DataParallel"
        )
    if p.votes:
        tally: dict[int, list[str]] = {}
        for vote in p.votes:
            tally.setdefault(vote.size, []).append(f"{vote.path} ({vote.source})")
        for size, voters in tally.items():
            lines.append(f"  {len(voters)} vote(s) for {size}: {', '.join(voters)}")
    names = ", ".join(str(d) for d in p.devices)
    lines.append(f"devices used ({len(p.devices)}): {names}")
    if len(p.waves) == 1:
        lines.append(f"chunk sizes: {p.waves[0]}")
    else:
        lines.append(f"waves ({len(p.waves)}): {p.waves}")
    rows = [("path", "what", "rule", "why")] + [(e.path, e.what, e.rule, e.why) for e in p.entries]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        lines.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    lines.append("each device receives (sizes and items one per chunk, in device order):")
    received = [("path", "moved to", "receives")] + [(e.path, e.to, e.receives) for e in p.entries]
    widths = [max(len(r[i]) for r in received) for i in range(2)]
    for path, to, receives in received:
        lines.append(f"  {path:<{widths[0]}}  {to:<{widths[1]}}  {receives}")
    for label, messages in (("warning: ", p.warnings), ("note: ", getattr(p, "notes", ()))):
        lines.extend(
            textwrap.fill(
                m,
                width=100,
                initial_indent=label,
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
            for m in messages
        )
    return "\n".join(lines)


def _and(names: list[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def warning_text(
    batch: int, how: str, voters: str, votes: Sequence[Voted], mismatched: list[tuple[str, str]]
) -> str:
    """The broadcast warning: what was found, then the fixes, the likeliest reading first.

    An input whose size is not ``B`` is most often shared on purpose (a batch-1 prompt, a
    lookup table), so the first fix offered is to mark that very input ``dp.Shared``, which
    silences the warning; the other reading (the input is batched and ``B`` is wrong) follows.
    """
    found = "; ".join(f"{path} has {what}" for path, what in mismatched)
    paths = [path for path, _ in mismatched]
    one = len(paths) == 1
    these = _and(paths)
    wrong = []
    if how.startswith("vote"):
        names = sorted(
            {v.path for v in votes if v.size == batch}, key=[v.path for v in votes].index
        )
        wrong.append(
            f"wrap {_and(names)} in dp.Shared(...) if "
            f"{'it is' if len(names) == 1 else 'they are'} not batched"
        )
    wrong.append("pass the right batch_size=N")
    split = these if one else f"the batched one of {these}"
    wrong.append(f"wrap {split} in dp.Split(...) to make its size the batch size")
    return (
        f"{found}, not the batch size {batch} ({voters}), so {'it is' if one else 'they are'} "
        f"broadcast whole to every device. To fix: wrap {these} in dp.Shared(...) if "
        f"{'it is' if one else 'they are'} meant to be shared (this also silences the "
        f"warning); if {'it is' if one else 'they are'} batched instead, the batch size is "
        f"wrong: {', or '.join(wrong)}. dp.plan(...) or DataParallel.explain(...) shows "
        f"every vote."
    )


def voters_phrase(batch: int, how: str, votes: Sequence[Voted]) -> str:
    """Who decided ``B``: ``"voted by args[0], kwargs['y']"`` or ``"set by batch_size="``."""
    if how.startswith("vote"):
        names = [v.path for v in votes if v.size == batch]
        return f"voted by {', '.join(names)}"
    return f"set by {how}"
