"""Chunk sizes: how a batch of ``B`` samples is cut over ``n`` devices, and into waves.

Default chunks are as even as possible (they differ by at most one, larger first) and no
device gets an empty chunk: with ``B < n`` fewer devices are used. ``chunk_sizes`` gives them
explicitly (0 skips a device), ``weights`` proportionally (largest remainder). ``max_size``
caps every chunk: the batch is cut into the fewest waves that fit, as even as possible.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["as_float", "as_int", "cut_batch", "even_sizes", "weighted_sizes"]


def even_sizes(batch: int, n: int) -> list[int]:
    """``n`` sizes summing to ``batch``, as even as possible, larger first, zeros last.

    >>> even_sizes(10, 3)
    [4, 3, 3]
    >>> even_sizes(2, 4)
    [1, 1, 0, 0]
    """
    used = min(batch, n)
    if used == 0:
        return [0] * n
    q, r = divmod(batch, used)
    return [q + 1] * r + [q] * (used - r) + [0] * (n - used)


def weighted_sizes(batch: int, weights: Sequence[float]) -> list[int]:
    """Sizes proportional to ``weights`` by the largest-remainder method (ties: earlier first).

    >>> weighted_sizes(10, [1, 1, 2])
    [3, 2, 5]
    """
    # Relative to the largest, so huge weights (1e308) cannot overflow the sum into inf.
    top = float(max(weights))
    scaled = [w / top for w in weights]
    total = sum(scaled)
    shares = [w * batch / total for w in scaled]
    sizes = [math.floor(s) for s in shares]
    left = batch - sum(sizes)
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    return sizes


def as_int(value: Any) -> Any:
    """``value`` as a Python int when it is an integer of another type (``np.int64``, a 0-dim
    integer tensor), else unchanged: the checks below then accept it or name it."""
    if isinstance(value, (bool, int)) or not hasattr(value, "__index__"):
        return value
    if getattr(value, "is_floating_point", lambda: False)():
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def as_float(value: Any) -> Any:
    """``value`` as a Python float when it is a real number of another type (``np.float32``, a
    0-dim tensor), else unchanged."""
    if isinstance(value, (bool, int, float)) or getattr(value, "dtype", None) is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return value


def _check_each(
    name: str,
    n: int,
    values: list[Any],
    noun: str,
    ok: Callable[[Any], bool],
    expected: str,
    advice: str,
) -> None:
    """What ``chunk_sizes`` and ``weights`` both need: one ``noun`` per device, each ``ok``
    (a bool never is: ``True`` is not a size)."""
    if len(values) != n:
        raise ValueError(
            f"{name}: expected one {noun} per device ({n}), got {len(values)}: {values!r}; "
            f"give 0 for a device to skip it"
        )
    for i, value in enumerate(values):
        if isinstance(value, bool) or not ok(value):
            raise ValueError(f"{name}[{i}]: expected {expected}, got {value!r}; {advice}")


def _check_chunk_sizes(batch: int, n: int, chunk_sizes: Sequence[int]) -> list[int]:
    sizes = [as_int(s) for s in chunk_sizes]
    _check_each(
        "chunk_sizes",
        n,
        sizes,
        "size",
        lambda s: isinstance(s, int) and s >= 0,
        "a non-negative int",
        f"chunk_sizes={sizes!r}",
    )
    if sum(sizes) != batch:
        raise ValueError(
            f"chunk_sizes: {sizes!r} sum to {sum(sizes)}, expected the batch size {batch}; "
            f"make them sum to {batch}, or use weights= for proportional chunks"
        )
    return sizes


def _check_weights(n: int, weights: Sequence[float]) -> list[float]:
    values = [as_float(w) for w in weights]
    _check_each(
        "weights",
        n,
        values,
        "weight",
        lambda w: isinstance(w, (int, float)) and math.isfinite(w) and w >= 0,
        "a finite number >= 0",
        "weights are relative shares such as [1, 2] (0 skips a device)",
    )
    if sum(values) <= 0:
        raise ValueError(
            f"weights: {values!r} are all zero, expected at least one positive weight; give the "
            f"devices to use a weight above 0"
        )
    return [float(w) for w in values]


def cut_batch(
    batch: int,
    n: int,
    *,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    max_size: int | None = None,
    allow_waves: bool = True,
) -> list[list[int]]:
    """The chunk sizes of each wave: a list of waves, each ``n`` sizes (0: device unused).

    Args:
        batch: ``B``, at least 1.
        n: the number of devices, at least 1.
        chunk_sizes: explicit sizes, one per device, summing to ``batch``.
        weights: relative shares, one per device.
        max_size: no chunk larger than this.
        allow_waves: when False (``scatter``), a batch that needs more than one wave under
            ``max_size`` is a ValueError instead.

    >>> cut_batch(10, 2, max_size=3)
    [[3, 2], [3, 2]]
    """
    if chunk_sizes is not None and weights is not None:
        raise ValueError("chunk_sizes and weights: expected one of them, got both; drop one")
    max_size = as_int(max_size)
    if max_size is not None and (
        isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1
    ):
        raise ValueError(f"max_size: expected an int >= 1, got {max_size!r}")
    if chunk_sizes is not None:
        sizes = _check_chunk_sizes(batch, n, chunk_sizes)
        if max_size is not None and max(sizes) > max_size:
            raise ValueError(
                f"chunk_sizes: {sizes!r} exceed max_size={max_size}; expected every chunk at "
                f"most {max_size}: lower them, or drop chunk_sizes to let waves cut the batch"
            )
        return [sizes]
    checked = None if weights is None else _check_weights(n, weights)

    def one_wave(size: int) -> list[int]:
        return even_sizes(size, n) if checked is None else weighted_sizes(size, checked)

    sizes = one_wave(batch)
    if max_size is None or max(sizes) <= max_size:
        return [sizes]
    if not allow_waves:
        raise ValueError(
            f"max_size: a batch of {batch} on {n} device(s) needs chunks of up to {max(sizes)}, "
            f"expected at most {max_size} per device in one round; add devices, raise "
            f"max_size, or pass a smaller batch (DataParallel runs a large one in waves)"
        )
    # The fewest waves whose chunks all fit; waves as even as possible, larger first.
    positive = n if checked is None else sum(1 for w in checked if w > 0)
    waves_needed = max(2, -(-batch // (max_size * positive)))
    for count in range(waves_needed, batch + 1):
        waves = [one_wave(size) for size in even_sizes(batch, count)]
        if all(max(w) <= max_size for w in waves):
            return waves
    raise ValueError(  # unreachable for max_size >= 1: waves of one sample always fit
        f"max_size: could not cut a batch of {batch} into chunks of at most {max_size}"
    )
