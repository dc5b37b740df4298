"""Which code is a library's: its state is searched for the tree but not watched.

Objects and functions of installed packages and the standard library (a logger, a config, a
registry) are the library's state, not the model's; watching them would cost every call. Code
is a library's when its file lies under the interpreter's standard library or site-packages,
unless it belongs to a package installed from a local directory (``pip install .`` without
``-e``: PEP 610's ``direct_url.json`` with ``dir_info``), which is the user's own project, as
it is when installed with ``-e``. This library's own code is a library's however it is
installed: a wrapper inside the model keeps its own per-call state, by its own rules. A
function is judged by where its code lies, so a hook of the user's decorated with
``functools.wraps(F.relu)`` (which copies ``__module__``) is the user's.
"""

from __future__ import annotations

import functools
import json
import os
import site
import sys
import sysconfig

__all__ = ["library_file", "library_module"]


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


_LIBRARY_ROOTS = _library_roots()
# This package's own folder (``.../dataparallel/``), wherever it lies: an editable install too.
_OWN_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")


@functools.lru_cache(maxsize=4096)
def library_module(name: str | None) -> bool:
    """Whether the module ``name`` is an installed package's or the standard library's (by
    where its file lies), not the user's script or project."""
    if not name or name == "__main__":
        return False
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if file is None:
        return module is not None and name in sys.builtin_module_names
    return library_file(file)


@functools.lru_cache(maxsize=4096)
def library_file(path: str) -> bool:
    """Whether the source file ``path`` lies in an installed package or the standard library,
    and not in a package of the user's installed from a local directory."""
    if not path or path.startswith("<"):  # (code made by exec or the interpreter)
        return False
    real = os.path.realpath(path)
    if real.startswith(_OWN_ROOT):
        return True
    for root in _LIBRARY_ROOTS:
        if real.startswith(root):
            top = real[len(root) :].split(os.sep, 1)[0]
            return not _installed_from_a_directory(top.removesuffix(".py"))
    return False


def _installed_from_a_directory(top: str) -> bool:
    """Whether the top-level package ``top`` came from a local directory (PEP 610)."""
    return top in _local_packages()


@functools.lru_cache(maxsize=1)
def _local_packages() -> frozenset[str]:
    """The top-level names of every package installed from a local directory, read once from
    the ``*.dist-info`` folders of the library roots that have a ``direct_url.json`` with
    ``dir_info`` (most have none: one listing per root)."""
    found: set[str] = set()
    for root in _LIBRARY_ROOTS:
        try:
            infos = [e for e in os.listdir(root) if e.endswith(".dist-info")]
        except OSError:
            continue
        for info in infos:
            folder = os.path.join(root, info)
            try:
                with open(os.path.join(folder, "direct_url.json"), encoding="utf-8") as f:
                    if json.load(f).get("dir_info") is None:
                        continue
            except (OSError, ValueError, AttributeError):
                continue
            found.update(_top_level(folder))
    return frozenset(found)


def _top_level(folder: str) -> set[str]:
    """The top-level names a ``*.dist-info`` folder installed (``top_level.txt``, else the
    first path parts of its ``RECORD``)."""
    try:
        with open(os.path.join(folder, "top_level.txt"), encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip()}
    except OSError:
        pass
    names: set[str] = set()
    try:
        with open(os.path.join(folder, "RECORD"), encoding="utf-8") as f:
            for line in f:
                first = line.split(",", 1)[0].split("/", 1)[0]
                if first and not first.endswith((".dist-info", ".data")) and first != "..":
                    names.add(first.removesuffix(".py"))
    except OSError:
        pass
    return names
