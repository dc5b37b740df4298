"""Markers that override what the batch rules infer: ``Shared`` and ``Split``."""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Shared", "Split"]

T = TypeVar("T")


class Shared(Generic[T]):
    """Broadcast ``obj`` to every device as is: never split, never cast, never a vote.

    Tensors inside are moved to each replica's device; everything else is shared by reference.
    Use it for inputs that are not batched, such as a lookup table or a batch-1 prompt. It
    raises nothing: whatever ``obj`` is, every replica receives it.

    Args:
        obj: any argument, or any part of one (``Shared`` may sit deep in a container).

    Example:
        >>> import torch, dataparallel as dp
        >>> table = torch.zeros(4, 3)  # 4 rows: without Shared, a vote for a batch of 4
        >>> p = dp.plan((torch.zeros(6, 3), dp.Shared(table)), None, ["cpu", "cpu"])
        >>> p.chunk_sizes, [e.rule for e in p.entries]
        ([3, 3], ['split', 'broadcast'])
    """

    __slots__ = ("obj",)

    def __init__(self, obj: T) -> None:
        self.obj = obj

    def __repr__(self) -> str:
        return f"Shared({self.obj!r})"


class Split(Generic[T]):
    """Split ``obj`` along the batch: a tensor or ndarray along ``dim``, a sequence by items.

    The first ``Split`` sets the batch size when ``batch_size=`` is not given; a ``Split`` whose
    size is not the batch size is an error. Use it to settle an ambiguity, such as a list of
    ``(3, H, W)`` images that would otherwise be cut by channel.

    Args:
        obj: a tensor, an ndarray, a list or a tuple.
        dim: the dimension to split a tensor or ndarray along; ``None`` means the call's ``dim``.

    Raises:
        ValueError: raised by the call that receives it (``dp.plan``, a wrapper's call), not
            here: its size is not the batch size, or ``obj`` cannot be split.

    Example:
        >>> import torch, dataparallel as dp
        >>> images = [torch.zeros(3, 8, 8) for _ in range(4)]  # 4 images, or 3 channels?
        >>> dp.plan((images,), None, ["cpu", "cpu"]).chunk_sizes  # cut by channel: 2 + 1
        [2, 1]
        >>> dp.plan((dp.Split(images),), None, ["cpu", "cpu"]).chunk_sizes  # by image
        [2, 2]
    """

    __slots__ = ("dim", "obj")

    def __init__(self, obj: T, dim: int | None = None) -> None:
        self.obj = obj
        self.dim = dim

    def __repr__(self) -> str:
        extra = "" if self.dim is None else f", dim={self.dim}"
        return f"Split({self.obj!r}{extra})"
