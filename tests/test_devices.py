from __future__ import annotations

import pytest
import torch

from dataparallel.devices import resolve_device, resolve_devices, target_device


def test_cpu_lists_keep_repeats() -> None:
    assert resolve_devices(["cpu", "cpu", torch.device("cpu")]) == [torch.device("cpu")] * 3


def test_single_spec_and_none() -> None:
    assert resolve_devices("cpu") == [torch.device("cpu")]
    expected = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [torch.device("cpu")]
    )
    assert resolve_devices(None) == expected


def test_empty_list_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"device_ids: expected at least one device, got an empty"):
        resolve_devices([])


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("gpu", r"device_ids\[1\]: expected a device such as 'cpu'.*got 'gpu'"),
        (-2, r"device_ids\[1\]: expected a CUDA index >= 0, got -2"),
        (True, r"device_ids\[1\]: expected a device .* got True"),
        (3.5, r"device_ids\[1\]: expected an int, a str or a torch.device, got float 3.5"),
    ],
)
def test_bad_specs_name_their_position(spec: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_devices(["cpu", spec])  # type: ignore[list-item]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_says_so() -> None:
    with pytest.raises(
        ValueError, match=r"device_ids\[0\]: 0 asks for CUDA, which is not available"
    ):
        resolve_devices([0])
    with pytest.raises(ValueError, match=r"'cuda:1' asks for CUDA"):
        resolve_device("cuda:1")


def test_minus_one_in_a_device_list_is_the_cpu() -> None:
    """mmcv's convention (MMDataParallel, scatter(..., [-1])): -1 is the CPU; each entry is one
    replica, as for "cpu"."""
    assert resolve_devices([-1]) == [torch.device("cpu")]
    assert resolve_devices([-1, -1]) == resolve_devices(["cpu", "cpu"])
    assert resolve_devices(-1) == [torch.device("cpu")]
    assert resolve_device(-1) == torch.device("cpu")
    with pytest.raises(
        ValueError,
        match=r"device_ids\[0\]: expected a CUDA index >= 0, got -3; "
        r"-1 means the CPU",
    ):
        resolve_devices([-3])


def test_target_device_minus_one_is_cpu() -> None:
    assert target_device(-1) == torch.device("cpu")
    assert target_device("cpu") == torch.device("cpu")


def test_a_resolved_list_passes_again_and_a_bad_device_still_fails() -> None:
    # resolve_devices skips the checks for devices it returned before: only for those.
    cpu = resolve_devices(["cpu", "cpu"])
    assert resolve_devices(cpu) == cpu and resolve_devices(cpu) is not cpu
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_devices([cpu[0], torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="at least one device"):
        resolve_devices([])
