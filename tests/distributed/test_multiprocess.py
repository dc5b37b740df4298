"""Real multi-process runs (gloo on the CPU, spawned workers with torchrun's variables).

Each test compares with the oracle: the same computation in one process on the whole batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # optimizers import it, and the import sets TORCHINDUCTOR_CACHE_DIR
import torch.nn.functional as F

from dataparallel.app.demo.models import Net
from dataparallel.distributed import (
    ShardedSampler,
    ddp_session,
    gather_all,
    shard,
)
from dataparallel.markers import Shared

from ._helpers import assert_same, distributed, run_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


# --------------------------------------------------------------------------- shard + gather_all


@dataclasses.dataclass
class Record:
    score: torch.Tensor
    tag: str


def global_batch(size: int) -> dict[str, Any]:
    """A nested heterogeneous batch of ``size`` samples (built the same on every rank)."""
    g = torch.Generator().manual_seed(size)
    return {
        "x": torch.randn(size, 3, generator=g),
        "names": [f"sample-{i}" for i in range(size)],
        # boxes per sample, 11 to 13 rows: never a chunk size, so they read as per-sample
        "boxes": [torch.randn(11 + i % 3, 4, generator=g) for i in range(size)],
        "meta": {"ids": torch.arange(size), "mask": torch.rand(size, generator=g) > 0.5},
        "record": Record(torch.randn(size, 2, generator=g), "run-1"),
        "table": Shared(torch.randn(6, 6, generator=g)),
    }


def expected_gather(size: int) -> dict[str, Any]:
    batch = global_batch(size)
    batch["table"] = batch["table"].obj
    return batch


def _shard_gather_worker(out_dir: str, sizes: list[int]) -> None:
    with distributed() as info:
        results = []
        for size in sizes:
            part = shard(global_batch(size))
            # the "model": per-sample outputs equal to the inputs, plus a mean loss (nan on a
            # rank with no samples: it must not spoil the global mean)
            gathered = gather_all({**part, "loss": part["x"].sum(1).mean()})
            results.append((len(part["names"]), gathered))
        torch.save(results, Path(out_dir) / f"rank{info.rank}.pt")
        # ranks that disagree on structure: a ValueError on every rank, listing every rank
        mismatched: dict[str, Any] = {"x": torch.zeros(2, 3)}
        if info.rank == 1:
            mismatched["extra"] = torch.ones(2)
        with pytest.raises(ValueError) as caught:
            gather_all(mismatched)
        Path(out_dir, f"rank{info.rank}.txt").write_text(str(caught.value))


@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_then_gather_all_gives_back_the_global_batch(tmp_path: Path, world_size: int) -> None:
    sizes = [7, 2, 10]  # uneven, fewer samples than ranks (an empty rank), even-ish
    run_workers(_shard_gather_worker, world_size, str(tmp_path), sizes)
    for rank in range(world_size):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for size, (local, gathered) in zip(sizes, results, strict=True):
            base, extra = divmod(size, world_size)
            assert local == base + (rank < extra)  # as even as possible, larger first
            expected = expected_gather(size)
            # a mean-reduced loss comes back as the mean over the global batch
            torch.testing.assert_close(gathered.pop("loss"), expected["x"].sum(1).mean())
            assert_same(gathered, expected, f"rank {rank}, batch of {size}")
        message = (tmp_path / f"rank{rank}.txt").read_text()
        # Issue 63, item 10: dp.gather's advice ("use gather=False") is no option of gather_all
        assert "gather=False" not in message and "replica" not in message, message
        assert "ranks disagree on the keys: rank 0 has ['x'], rank 1 has ['x', 'extra']" in message
        assert "Return the same keys on every rank" in message
        assert "rank 0 (batch 2): {'x': Tensor(2, 3):float32}" in message
        assert (
            "rank 1 (batch 2): {'x': Tensor(2, 3):float32, 'extra': Tensor(2,):float32}" in message
        )
        if world_size == 3:
            assert "rank 2 (batch 2): {'x': Tensor(2, 3):float32}" in message


def _empty_rank_worker(out_dir: str) -> None:
    with distributed() as info:
        n = 3 if info.rank == 0 else 0
        loss = torch.arange(n, dtype=torch.float32).mean()  # nan on the empty rank
        out = {
            "pred": torch.arange(n),
            "failed": torch.tensor(1 + 3 * info.rank),
            "failed_int": 1 + 3 * info.rank,
            "host": [f"host{info.rank}"],
            "loss": loss,
        }
        torch.save(gather_all(out), Path(out_dir) / f"rank{info.rank}.pt")


def test_an_empty_rank_counts_in_gather_all_but_weighs_nothing_in_a_mean(tmp_path: Path) -> None:
    """Issue 51, item 1: rank 1 with no samples was left out whole, so its failures, its int
    count and its host were lost (``failed=1``, ``['host0']``) with no warning. Now only its
    weight in the mean is 0: its nan loss spoils nothing, and everything else counts, as one
    process over both ranks' work would count it."""
    run_workers(_empty_rank_worker, 2, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert torch.equal(got["pred"], torch.arange(3)), rank
        assert int(got["failed"]) == 5 and got["failed_int"] == 5, (rank, got)
        assert got["host"] == [["host0", "host1"]], (rank, got)
        torch.testing.assert_close(got["loss"], torch.tensor(1.0))


# --------------------------------------------------------------------------- DDP training


STEP_BATCHES = [8, 8, 5]  # the last global batch is uneven over two ranks (3 + 2)


def _data(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, 1, 8, 8, generator=g), torch.randint(0, 10, (b,), generator=g))
        for b in STEP_BATCHES
    ]


def _new_model() -> Net:
    torch.manual_seed(0)
    return Net(1, 8, 10)


def _ddp_worker(out_dir: str) -> None:
    with ddp_session(_new_model()) as (ddp, info):
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for x, y in _data():
            xs, ys = shard((x, y))
            optimizer.zero_grad()
            # DDP averages gradients over ranks: a per-rank sum scaled by world / global batch
            # makes that average the mean over the global batch, even with uneven shards.
            loss = F.cross_entropy(ddp(xs), ys, reduction="sum") * info.world_size / len(y)
            loss.backward()
            optimizer.step()
        state = {k: v.detach().cpu() for k, v in ddp.module.state_dict().items()}
        torch.save(state, Path(out_dir) / f"rank{info.rank}.pt")


def test_ddp_training_equals_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    run_workers(_ddp_worker, 2, str(tmp_path))
    reference = _new_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data():
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    initial = _new_model().state_dict()
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key, value in reference.state_dict().items():
        assert not torch.allclose(value, initial[key])  # training moved it
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
        torch.testing.assert_close(states[0][key], value, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- evaluation


EVAL_SIZE = 22  # global batches of 10: 10, 10, 2 -> the last leaves rank 2 empty
SAMPLER_SIZE = 25  # 9/8/8 samples per rank: 3, 2 and 2 batches of 4


def _eval_data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(size)
    return torch.randn(size, 1, 8, 8, generator=g), torch.randint(0, 10, (size,), generator=g)


def _eval_worker(out_dir: str) -> None:
    with distributed() as info:
        model = _new_model().eval()
        x, y = _eval_data(EVAL_SIZE)
        ids = [f"id{i}" for i in range(EVAL_SIZE)]
        seen: list[str] = []
        correct = 0
        with torch.no_grad():
            for start in range(0, EVAL_SIZE, 10):
                batch = (x[start : start + 10], y[start : start + 10], ids[start : start + 10])
                xs, ys, names = shard(batch)
                out = gather_all({"hit": model(xs).argmax(1) == ys, "name": names})
                correct += int(out["hit"].sum())
                seen += out["name"]
            # a sampler over the dataset: ranks run different numbers of batches, so each
            # collects locally and gathers once at the end
            dx, dy = _eval_data(SAMPLER_SIZE)
            sampler = ShardedSampler(range(SAMPLER_SIZE), shuffle=False)
            loader = torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(dx, dy, torch.arange(SAMPLER_SIZE)),
                batch_size=4,
                sampler=sampler,
            )
            preds, index = [], []
            for bx, _by, bi in loader:
                preds.append(model(bx).argmax(1))
                index.append(bi)
            total = gather_all({"pred": torch.cat(preds), "index": torch.cat(index)})
        torch.save(
            {"correct": correct, "seen": seen, "total": total, "batches": len(loader)},
            Path(out_dir) / f"rank{info.rank}.pt",
        )


def test_evaluation_counts_every_sample_once(tmp_path: Path) -> None:
    run_workers(_eval_worker, 3, str(tmp_path))
    model = _new_model().eval()
    with torch.no_grad():
        x, y = _eval_data(EVAL_SIZE)
        expected_correct = int((model(x).argmax(1) == y).sum())
        dx, _ = _eval_data(SAMPLER_SIZE)
        expected_pred = model(dx).argmax(1)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    assert [r["batches"] for r in results] == [3, 2, 2]
    for result in results:
        assert result["seen"] == [f"id{i}" for i in range(EVAL_SIZE)]
        assert result["correct"] == expected_correct
        assert result["correct"] / EVAL_SIZE == expected_correct / EVAL_SIZE
        assert torch.equal(result["total"]["index"], torch.arange(SAMPLER_SIZE))
        assert torch.equal(result["total"]["pred"], expected_pred)
