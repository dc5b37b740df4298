"""init_distributed, shard, gather_all and ddp_session in one process (no torchrun variables)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # DDP imports it, and the import sets TORCHINDUCTOR_CACHE_DIR
import torch.distributed as dist

from dataparallel.distributed import (
    ENV_VARS,
    DistInfo,
    ddp_session,
    gather_all,
    init_distributed,
    shard,
)


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_incomplete_environment_names_the_missing_variables(
    no_torchrun_env: pytest.MonkeyPatch,
) -> None:
    no_torchrun_env.setenv("RANK", "0")
    no_torchrun_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError) as info:
        init_distributed()
    message = str(info.value)
    assert "['LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT']" in message
    assert "torchrun" in message and "dataparallel train --strategy ddp" in message
    assert not dist.is_initialized()


def test_non_integer_rank_is_a_clear_error(no_torchrun_env: pytest.MonkeyPatch) -> None:
    for name, value in zip(ENV_VARS, ["zero", "2", "0", "127.0.0.1", "1234"], strict=True):
        no_torchrun_env.setenv(name, value)
    with pytest.raises(ValueError, match=r"RANK: expected an integer, got 'zero'"):
        init_distributed()


def test_rank_out_of_range_is_a_clear_error(no_torchrun_env: pytest.MonkeyPatch) -> None:
    for name, value in zip(ENV_VARS, ["2", "2", "0", "127.0.0.1", "1234"], strict=True):
        no_torchrun_env.setenv(name, value)
    with pytest.raises(ValueError, match=r"got RANK=2, WORLD_SIZE=2"):
        init_distributed()


def test_no_environment_is_one_process(no_torchrun_env: pytest.MonkeyPatch) -> None:
    info = init_distributed()
    expected_device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert info == DistInfo(0, 0, 1, expected_device, None)
    assert info.is_main
    assert not dist.is_initialized()  # no process group is needed for one process
    with pytest.raises(AttributeError):
        info.rank = 1  # type: ignore[misc]  # frozen


def test_shard_and_gather_all_in_one_process(no_torchrun_env: pytest.MonkeyPatch) -> None:
    batch = (torch.arange(12.0).reshape(6, 2), ["a", "b", "c", "d", "e", "f"])
    part = shard(batch, device="cpu")
    assert torch.equal(part[0], batch[0]) and part[1] == batch[1]
    back = gather_all({"x": part[0], "names": part[1]}, device="cpu")
    assert torch.equal(back["x"], batch[0]) and back["names"] == batch[1]
    # a list of strings alone: its length is the chunk size, so it stays per-sample
    assert gather_all(["p", "q"], device="cpu") == ["p", "q"]


def test_shard_splits_as_scatter_with_explicit_ranks() -> None:
    x = torch.arange(7)
    parts = [shard(x, rank=r, world_size=3, device="cpu") for r in range(3)]
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    sizes = [shard(x, rank=r, world_size=3, chunk_sizes=[5, 0, 2], device="cpu") for r in range(3)]
    assert [p.tolist() for p in sizes] == [[0, 1, 2, 3, 4], [], [5, 6]]
    # fewer samples than ranks: the last ranks get an empty slice, nothing is duplicated
    small = [shard((x[:2], ["u", "v"]), rank=r, world_size=3, device="cpu") for r in range(3)]
    assert [(p[0].tolist(), p[1]) for p in small] == [([0], ["u"]), ([1], ["v"]), ([], [])]
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size=3, got 3"):
        shard(x, rank=3, world_size=3)


def test_shard_rejects_a_batch_that_needs_waves() -> None:
    needs_waves = (
        r"max_size: a batch of 7 on 2 device\(s\) needs chunks of up to 4, expected at most 2"
    )
    with pytest.raises(ValueError, match=needs_waves):
        shard(torch.arange(7), rank=0, world_size=2, device="cpu", max_size=2)


def test_ddp_session_in_one_process_destroys_its_group(no_torchrun_env: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(3, 2)
    with ddp_session(model) as (ddp, info):
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert info.world_size == 1 and info.backend in {"gloo", "nccl"}
        ddp(torch.randn(4, 3)).sum().backward()
        assert model.weight.grad is not None
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="boom"), ddp_session(torch.nn.Linear(3, 2)):
        raise RuntimeError("boom")
    assert not dist.is_initialized()
