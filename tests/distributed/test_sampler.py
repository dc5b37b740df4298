"""ShardedSampler: an exact partition of the indices over ranks (pure Python, no processes)."""

from __future__ import annotations

import pytest

from dataparallel.distributed import ShardedSampler


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_index_exactly_once(shuffle: bool) -> None:
    for length in range(51):
        for world_size in range(1, 6):
            parts = [
                list(
                    ShardedSampler(
                        range(length), shuffle=shuffle, seed=3, rank=r, world_size=world_size
                    )
                )
                for r in range(world_size)
            ]
            union = [i for part in parts for i in part]
            assert sorted(union) == list(range(length)), (length, world_size)
            counts = [len(part) for part in parts]
            assert counts == [
                len(ShardedSampler(range(length), shuffle=shuffle, rank=r, world_size=world_size))
                for r in range(world_size)
            ]
            # as even as possible, the larger parts first (the split shard() makes)
            assert max(counts) - min(counts) <= 1
            assert counts == sorted(counts, reverse=True)


def test_unshuffled_blocks_are_the_dataset_order_in_rank_order() -> None:
    parts = [list(ShardedSampler(range(11), shuffle=False, rank=r, world_size=3)) for r in range(3)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]


def test_set_epoch_reshuffles_deterministically() -> None:
    def epoch_order(epoch: int, seed: int = 7) -> list[list[int]]:
        parts = []
        for r in range(3):
            sampler = ShardedSampler(list(range(40)), shuffle=True, seed=seed, rank=r, world_size=3)
            sampler.set_epoch(epoch)
            parts.append(list(sampler))
        return parts

    first, again, second = epoch_order(0), epoch_order(0), epoch_order(1)
    assert first == again  # same seed and epoch: same order, on every rank independently
    assert first != second  # a new epoch: a new order
    for parts in (first, second):
        assert sorted(i for p in parts for i in p) == list(range(40))
    assert first != epoch_order(0, seed=8)
    sampler = ShardedSampler(range(40), seed=7, rank=0, world_size=3)
    before = list(sampler)
    sampler.set_epoch(5)
    assert list(sampler) != before and list(sampler) == epoch_order(5)[0]


def test_defaults_to_one_process_and_rejects_bad_ranks() -> None:
    sampler = ShardedSampler(range(6), shuffle=False)
    assert (sampler.rank, sampler.world_size, list(sampler)) == (0, 1, list(range(6)))
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < world_size=2, got 2"):
        ShardedSampler(range(6), rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size: expected at least 1, got 0"):
        ShardedSampler(range(6), rank=0, world_size=0)
    with pytest.raises(ValueError, match=r"dataset: expected an object with len\(\)"):
        ShardedSampler(iter(range(6)), rank=0, world_size=1)  # type: ignore[arg-type]


def test_reads_rank_from_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = ShardedSampler(range(5), shuffle=False)
    assert (sampler.rank, sampler.world_size, list(sampler)) == (1, 2, [3, 4])
