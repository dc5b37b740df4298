"""gather_all of counts and of a loss alone, on 2 real ranks, against one process on all data.

An evaluation loop's ``{"correct": c, "total": t}`` as Python ints, equal on both ranks, is read
by the gather rules as a constant; a loss gathered alone has no size beside it, so its mean is
unweighted. Both warn on rank 0, naming the rule and the fix, and the fixes give one process's
figures.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from dataparallel.distributed import ShardedSampler, gather_all

from ._helpers import distributed, run_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SIZE = 10  # 5 samples per rank on 2 ranks


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(SIZE, 4, generator=g)
    labels = scores.argmax(1)
    labels[[0, 9]] = (labels[[0, 9]] + 1) % 4  # one miss per rank: both count 4 right of 5
    return scores, labels


def _losses(rank: int, sizes: tuple[int, int]) -> torch.Tensor:
    values = torch.arange(1.0, 1.0 + sum(sizes))  # one loss per sample: 1, 2, ...
    return values[: sizes[0]] if rank == 0 else values[sizes[0] :]


def _worker(out_dir: str) -> None:
    with distributed() as info:
        scores, labels = _data()
        index = ShardedSampler(range(SIZE), shuffle=False).indices()
        hits = scores[index].argmax(1) == labels[index]
        results: dict[str, object] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = {"correct": int(hits.sum()), "total": len(index)}
            results["ints"] = gather_all(metrics)
            results["ints, rules"] = gather_all(
                metrics, output_rules={"output['correct']": "sum", "output['total']": "sum"}
            )
            results["tensors"] = gather_all({k: torch.tensor(v) for k, v in metrics.items()})
            for sizes in ((3, 1), (4, 0)):
                part = _losses(info.rank, sizes)
                results[f"loss {sizes}"] = gather_all(part.mean())
                results[f"loss {sizes}, batch_size"] = gather_all(part.mean(), batch_size=len(part))
        results["warnings"] = [str(w.message) for w in caught]
        torch.save(results, Path(out_dir) / f"rank{info.rank}.pt")


def test_counts_and_a_lone_loss_give_one_process_figures_or_warn(tmp_path: Path) -> None:
    run_workers(_worker, 2, str(tmp_path))
    scores, labels = _data()
    correct = int((scores.argmax(1) == labels).sum())  # one process, all the data
    assert correct == 8
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # the gather rule: an int equal on every rank is a constant (returned once)...
        assert got["ints"] == {"correct": 4, "total": 5}
        # ...and the fixes the warning names give one process's counts
        assert got["ints, rules"] == {"correct": correct, "total": SIZE}
        assert {k: int(v) for k, v in got["tensors"].items()} == {"correct": correct, "total": SIZE}
        for sizes in ((3, 1), (4, 0)):
            expected = torch.arange(1.0, 1.0 + sum(sizes)).mean()  # one process: 2.5
            torch.testing.assert_close(got[f"loss {sizes}, batch_size"], expected)
            assert not torch.allclose(got[f"loss {sizes}"], expected, equal_nan=True)
        messages = got["warnings"]
        if rank == 1:
            assert messages == []  # the same values on every rank: rank 0 alone says it
            continue
        assert len(messages) == 4, messages
        text = next(m for m in messages if m.startswith("gather_all: output['total']"))
        assert text.startswith("gather_all: output['total'] is the Python int 5 on every one of")
        assert "would give 10 if it is a count" in text
        assert "torch.tensor(n)" in text and "output_rules={\"output['total']\": 'sum'}" in text
        assert any(
            m.startswith("gather_all: output['correct'] is the Python int 4") for m in messages
        )
        lone = [m for m in messages if "float scalar" in m]
        assert len(lone) == 2 and "[2.0, 4.0]" in lone[0] and "nan" in lone[1]
        assert all("batch_size=" in m for m in lone)
