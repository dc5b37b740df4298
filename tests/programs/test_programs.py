"""The corpus of ported programs (issue 49, item 6): each against its own one-device run, on
every CPU list (see ``_harness``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from ._harness import LISTS, check, differences

PROGRAMS = sorted(p.stem for p in Path(__file__).parent.glob("p_*.py"))
# Programs known to differ from one device (``d_*``): kept to check that ``check=`` says so.
DIFFERING = sorted(p.stem for p in Path(__file__).parent.glob("d_*.py"))


def _program(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


@pytest.mark.parametrize("devices", LISTS, ids=lambda d: ",".join(d))
@pytest.mark.parametrize("name", PROGRAMS)
def test_the_program_runs_as_on_one_device(name: str, devices: list[str]) -> None:
    # check="raise" on the first list (issue 61): the library's own comparison finds nothing,
    # and the run through it is the same run
    check(_program(name), devices, one_device="raise" if devices == LISTS[0] else None)


def test_a_minibatch_statistic_is_reported_by_check() -> None:
    """rosinality's discriminator takes the standard deviation over the batch in forward:
    ``check=`` names the output, and the gradients through it."""
    found = differences(_program("d_style_gan"), LISTS[0])
    assert found, "check= reported nothing"
    assert found[0].startswith("check=: differs from one device: output: differs by"), found
    assert "no rule of the library covers it" in found[0]
    assert any("grad of final.0.weight (through output)" in m for m in found), found


@pytest.mark.parametrize("name", PROGRAMS + DIFFERING)
def test_the_program_names_its_source(name: str) -> None:
    doc = _program(name).__doc__ or ""
    sources = [line for line in doc.splitlines() if line.startswith("Source: ")]
    assert len(sources) == 1, f"{name}: expected one 'Source: owner/repo path' line"
    owner_repo, path = sources[0].removeprefix("Source: ").split(" ", 1)
    assert owner_repo.count("/") == 1 and path.endswith(".py"), sources[0]


def test_clips_own_forward_is_refused_with_the_port() -> None:
    """The script's forward computes the logits over the chunk's own samples: on uneven
    chunks the wrapper refuses it and names the port that ``p_clip`` takes."""
    import dataparallel as dp

    from .p_clip import CLIP, batches

    image, text = batches()[0]  # 7 samples: chunks 4 and 3
    with pytest.raises(ValueError, match="compute the matrix outside the wrapper"):
        dp.DataParallel(CLIP(logits_inside=True), ["cpu", "cpu"])(image, text)


def test_forward_data_writes_an_earlier_backward_reads_are_reported_by_check() -> None:
    """heykeetae's SAGAN: D twice, then one backward, its spectral norm writing ``u``, ``v``
    through ``.data``. ``check=`` follows both calls on its copy, so it reports the gradient the
    harness finds different; where that family is made exact, it reports nothing."""
    program = _program("d_sagan")
    found = differences(program, LISTS[0])
    try:
        check(program, LISTS[0])
    except AssertionError:
        assert any(m.startswith("check=: differs from one device: grad of l1.0.") for m in found)
        assert all("output" not in m.split(" (through")[0] for m in found), found
    else:
        assert found == []
