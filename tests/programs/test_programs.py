"""The corpus of ported programs (issue 49, item 6): each against its own one-device run, on
every CPU list (see ``_harness``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from ._harness import LISTS, check

PROGRAMS = sorted(p.stem for p in Path(__file__).parent.glob("p_*.py"))


def _program(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


@pytest.mark.parametrize("devices", LISTS, ids=lambda d: ",".join(d))
@pytest.mark.parametrize("name", PROGRAMS)
def test_the_program_runs_as_on_one_device(name: str, devices: list[str]) -> None:
    check(_program(name), devices)


@pytest.mark.parametrize("name", PROGRAMS)
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
