"""A sampler that splits a dataset's indices exactly over the ranks, as ``shard`` splits a batch.

A sampler, not a batch helper: it decides which samples each rank loads, before any batch
exists, so ranks never load what they would throw away.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from dataparallel.distributed._process import rank_and_size

__all__ = ["ShardedSampler"]


class ShardedSampler(Sampler[int]):
    """An exact partition of a dataset's indices over the ranks: every index exactly once.

    The indices (shuffled from ``seed + epoch`` when ``shuffle``) are cut into ``world_size``
    contiguous blocks, as even as possible with the larger blocks first, the same split
    :func:`shard` makes of a batch. Nothing is padded or dropped, so ranks may get one sample
    more or fewer; in rank order the blocks are the whole (shuffled) order, so
    :func:`gather_all` of per-sample outputs, gathered once after the loop, comes back in the
    dataset's order when ``shuffle=False``.

    With uneven blocks ranks may run different numbers of batches: for evaluation gather once
    at the end; for DDP training give every rank the same number of steps, a rank with no batch
    left stepping on zero samples (see :func:`ddp_session`), so every optimizer steps alike.

    Args:
        dataset: anything with ``len()``.
        shuffle: shuffle the indices each epoch (the same permutation on every rank).
        seed: the base seed; every rank must use the same one.
        rank: this rank; ``None`` reads the process group (or ``RANK``, else 0).
        world_size: number of ranks; ``None`` reads the process group (or ``WORLD_SIZE``, else 1).

    Raises:
        ValueError: ``dataset`` has no ``len()`` (an ``IterableDataset``), or ``rank`` or
            ``world_size`` is not an int, or out of range.

    Example:
        >>> import dataparallel as dp
        >>> [list(dp.ShardedSampler(range(5), shuffle=False, rank=r, world_size=2)) for r in (0, 1)]
        [[0, 1, 2], [3, 4]]
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                f"dataset: expected an object with len(), got {type(dataset).__name__}; "
                f"an IterableDataset must be split by the dataset itself"
            )
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank, self.world_size = rank_and_size(rank, world_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``seed + epoch`` from now on (call it before each epoch)."""
        self.epoch = int(epoch)

    def _bounds(self) -> tuple[int, int]:
        total = len(self.dataset)
        base, extra = divmod(total, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch, in the order they are yielded."""
        start, stop = self._bounds()
        if not self.shuffle:
            return list(range(start, stop))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)
        return order[start:stop].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        start, stop = self._bounds()
        return stop - start
