"""Sphinx configuration: the API reference from the docstrings, with the guide beside it.

``make docs`` builds it into docs/_build/html with warnings as errors and nitpicky references
(``-W --keep-going -n``). Docstrings are Google-style (napoleon); the Markdown pages (the guide,
the benchmarks) are read by myst-parser. Nothing is fetched: names from torch and the standard
library are left unlinked (``nitpick_ignore_regex``) rather than read from intersphinx
inventories, so the build needs no network.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The source tree, not an installed copy: the reference documents the code beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import dataparallel

project = "dataparallel"
author = "the dataparallel authors"
copyright = "the dataparallel authors"
release = version = dataparallel.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

html_theme = "furo"
html_title = f"dataparallel {release}"

# Google-style sections only; types come from the annotations, written into each argument's
# description, so they cannot drift from the code.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"

# The guide's "#### The labels' rule" and the like become link targets (slugs).
myst_heading_anchors = 4

# Names outside this project: no intersphinx (no network at build time), so not linked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|collections|contextlib|threading|numpy|datetime|os)(\..*)?"),
    (r"py:.*", r"DistributedDataParallel"),
    (r"py:.*", r"(nn|Tensor|Module|Any|Callable|Iterator|Mapping|Sequence|Iterable)(\..*)?"),
    (r"py:class", r"(int|str|float|bool|object|dict|list|tuple|type|None|NoneType)"),
]
# Private names in public signatures: ``ScalarMode`` is ``"mean" | "sum" | "stack"`` and a
# ``SyncCall`` is made by the library, never by the caller; the Args sections say what to pass.
nitpick_ignore = [
    ("py:class", "ScalarMode"),
    ("py:class", "T"),  # the markers' type variable: Shared(obj) and Split(obj) take any obj
    ("py:class", "dataparallel.parallel_apply._rendezvous.SyncCall"),
]

# The public type aliases, as annotations name them (``DeviceSpec``): Sphinx 9 finds them under
# ``.. currentmodule:: dataparallel``, Sphinx 8 looks for the bare name; both link to the entry.
_ALIASES = {"DeviceSpec", "ScalarWeights"}


def _link_alias(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    target = node.get("reftarget")
    if node.get("refdomain") != "py" or target not in _ALIASES:
        return None
    python = env.get_domain("py")
    return python.resolve_xref(
        env, node["refdoc"], app.builder, "data", f"dataparallel.{target}", node, contnode
    )


def setup(app: Any) -> None:
    app.connect("missing-reference", _link_alias)
