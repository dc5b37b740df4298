"""Library state is decided by where code lies and how its package was installed (issue 60,
item 6): a package of the user's installed from a local directory without ``-e`` (in
site-packages, with PEP 610's ``direct_url.json``) is the user's, so what its hooks read is
watched; an installed package from an index stays a library's."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.replicate import _library

PACKAGE = """
MODELS = []


def count(module, args, out):
    for model in MODELS:  # module-level state, filled after the first calls
        model.calls += 1
"""


def _clear() -> None:
    _library.library_file.cache_clear()
    _library.library_module.cache_clear()
    _library._local_packages.cache_clear()


@pytest.fixture
def site_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A site-packages of its own, on ``sys.path`` and among the library roots."""
    root = tmp_path / "site-packages"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(_library, "_LIBRARY_ROOTS", (str(root.resolve()) + "/",))
    _clear()
    yield root
    _clear()
    for name in [n for n in sys.modules if n.startswith("userpkg")]:
        del sys.modules[name]


def _install(root: Path, name: str, url: dict[str, object] | None) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    if url is not None:
        (info / "direct_url.json").write_text(json.dumps(url))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _calls_per_call(name: str) -> list[int]:
    package = importlib.import_module(name)
    model = Net()
    model.lin.register_forward_hook(package.count)
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    counts = []
    for step in range(3):
        if step == 1:
            package.MODELS.append(model)
        before = model.calls
        wrapper(torch.randn(4, 3))
        counts.append(model.calls - before)
    return counts


def test_a_package_installed_from_a_local_directory_is_the_users(site_root: Path) -> None:
    _install(site_root, "userpkg_local", {"url": "file:///home/me/proj", "dir_info": {}})
    assert not _library.library_module("userpkg_local")
    # one device: 0, 1, 1 (before: 0, 2, 2, the list filled later never compared)
    assert _calls_per_call("userpkg_local") == [0, 1, 1]


def test_a_package_installed_from_an_index_is_a_librarys(site_root: Path) -> None:
    _install(site_root, "userpkg_index", None)
    importlib.import_module("userpkg_index")
    assert _library.library_module("userpkg_index")


def test_this_librarys_own_code_is_a_librarys_however_it_is_installed(site_root: Path) -> None:
    # the library roots hold none of this checkout (an editable install, or ``src`` on the path)
    assert not any(dp.__file__.startswith(root) for root in _library._LIBRARY_ROOTS)
    assert _library.library_module("dataparallel.wrapper._results")
    assert _library.library_file(dp.DataParallel.forward.__code__.co_filename)
    assert not _library.library_module(__name__)  # the user's code (this test) stays the user's
