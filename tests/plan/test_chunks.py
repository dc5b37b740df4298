from __future__ import annotations

import pytest

from dataparallel.plan._chunks import cut_batch, even_sizes, weighted_sizes


@pytest.mark.parametrize(
    ("batch", "n", "expected"),
    [
        (16, 4, [4, 4, 4, 4]),
        (10, 3, [4, 3, 3]),
        (30, 3, [10, 10, 10]),
        (2, 4, [1, 1, 0, 0]),
        (1, 8, [1, 0, 0, 0, 0, 0, 0, 0]),
        (7, 1, [7]),
    ],
)
def test_even_sizes(batch: int, n: int, expected: list[int]) -> None:
    assert even_sizes(batch, n) == expected


def test_even_sizes_differ_by_at_most_one_and_sum() -> None:
    for batch in range(1, 60):
        for n in range(1, 9):
            sizes = even_sizes(batch, n)
            used = [s for s in sizes if s]
            assert sum(sizes) == batch
            assert len(used) == min(batch, n)
            assert max(used) - min(used) <= 1
            assert used == sorted(used, reverse=True)


def test_weights_largest_remainder() -> None:
    assert weighted_sizes(10, [1, 1, 2]) == [3, 2, 5]
    assert weighted_sizes(16, [1, 3]) == [4, 12]
    # a device whose share rounds to 0 gets nothing (and is skipped by the plan)
    assert weighted_sizes(3, [0.01, 1, 1]) == [0, 2, 1]
    for batch in range(1, 40):
        assert sum(weighted_sizes(batch, [0.3, 1.7, 2.0])) == batch


def test_max_size_waves_are_fewest_and_even() -> None:
    waves = cut_batch(16, 4, max_size=3)
    assert waves == [[2, 2, 2, 2], [2, 2, 2, 2]]
    waves = cut_batch(10, 2, max_size=3)
    assert waves == [[3, 2], [3, 2]]
    for batch in range(1, 50):
        for cap in range(1, 6):
            waves = cut_batch(batch, 3, max_size=cap)
            assert sum(map(sum, waves)) == batch
            assert max(max(w) for w in waves) <= cap
            assert len(waves) == max(1, -(-batch // (3 * cap)))


def test_max_size_with_weights_fits() -> None:
    waves = cut_batch(20, 2, weights=[1, 3], max_size=5)
    assert all(max(w) <= 5 for w in waves)
    assert sum(map(sum, waves)) == 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_sizes": [8, 7]}, r"chunk_sizes: \[8, 7\] sum to 15, expected the batch size 16"),
        ({"chunk_sizes": [8, 8, 0]}, r"chunk_sizes: expected one size per device \(2\), got 3"),
        ({"chunk_sizes": [20, -4]}, r"chunk_sizes\[1\]: expected a non-negative int, got -4"),
        ({"weights": [0, 0]}, r"weights: \[0, 0\] are all zero, expected at least one positive"),
        ({"weights": [1]}, r"weights: expected one weight per device \(2\), got 1"),
        ({"weights": [1, -1]}, r"weights\[1\]: expected a finite number >= 0, got -1"),
        ({"chunk_sizes": [8, 8], "weights": [1, 1]}, r"expected one of them, got both"),
        ({"max_size": 0}, r"max_size: expected an int >= 1, got 0"),
        ({"chunk_sizes": [12, 4], "max_size": 8}, r"chunk_sizes: \[12, 4\] exceed max_size=8"),
        (
            {"max_size": 4, "allow_waves": False},
            r"max_size: a batch of 16 on 2 device\(s\) needs chunks of up to 8, expected at most 4",
        ),
    ],
)
def test_bad_chunk_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cut_batch(16, 2, **kwargs)  # type: ignore[arg-type]
