"""The API reference covers every public name, and every public docstring is one a user can act on.

The reference is built by ``make docs`` (Sphinx, docs/api/*.rst); these tests read its sources,
so they need no Sphinx: a name in ``dataparallel.__all__`` without an entry fails here, as does
an entry for a name that is not public. The docstrings themselves (what ``help()`` prints and the
reference renders) are checked for their sections, for names a user cannot import, and for
examples that run: each public name's examples run as doctests, on the CPU, in this suite.
"""

from __future__ import annotations

import doctest
import inspect
import pydoc
import re
from pathlib import Path
from typing import Any

import pytest

import dataparallel as dp

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
PUBLIC = [name for name in dp.__all__ if name != "__version__"]
# Type aliases: their text lives in the reference (docs/api), not in a docstring of their own
# (a ``TypeAlias`` is a plain value at run time, with no docstring to give ``help()``).
ALIASES = {"DeviceSpec", "ScalarWeights"}
# Records the library makes and hands back (a call's load, a plan's rows, a rank's facts): built
# from values already checked, they raise nothing a user could meet.
RECORDS = {"CallStats", "DeviceOutputs", "DistInfo", "Entry", "Plan", "Vote"}
# DataParallel's public methods and attributes, as help(dp.DataParallel) lists them.
WRAPPER_MEMBERS = [
    "__init__",
    "forward",
    "explain",
    "last_call",
    "train_step",
    "val_step",
    "test_step",
    "scatter",
    "replicate",
    "parallel_apply",
    "gather",
    "state_dict",
    "load_state_dict",
]

_DIRECTIVE = re.compile(
    r"^\.\. (?:auto)?(?:class|function|data|attribute|exception|decorator)::\s+(\S+)", re.M
)
_MODULE = re.compile(r"^\.\. currentmodule::\s+(\S+)", re.M)
# A private module or a private name of one (``dataparallel.wrapper._labels``, ``_saving``),
# or a file of the source tree a user of the wheel does not have.
_PRIVATE = re.compile(r"dataparallel(?:\.\w+)*\._\w+|``_[a-z]\w*``|\(_[a-z]\w*\)|\w+\.md\b")


def reference_entries() -> dict[str, str]:
    """``{qualified name: page}`` for every object entry of docs/api/*.rst."""
    found: dict[str, str] = {}
    for page in sorted(API.glob("*.rst")):
        text = page.read_text(encoding="utf-8")
        modules = _MODULE.findall(text)
        for name in _DIRECTIVE.findall(text):
            module = modules[0] if modules and "." not in name else ""
            found[f"{module}.{name}" if module else name] = page.name
    return found


def test_every_public_name_has_one_reference_entry() -> None:
    entries = reference_entries()
    missing = [n for n in dp.__all__ if f"dataparallel.{n}" not in entries]
    assert not missing, f"public names with no entry in docs/api/*.rst: {missing}"
    stale = [e for e in entries if e.removeprefix("dataparallel.") not in dp.__all__]
    assert not stale, f"entries in docs/api/*.rst for names not in dataparallel.__all__: {stale}"


def test_the_signatures_name_only_exported_types() -> None:
    # DeviceSpec and ScalarWeights appear in public signatures: a user can import and read them
    assert {"DeviceSpec", "ScalarWeights"} <= set(dp.__all__)
    assert dp.DeviceSpec is not None and dp.ScalarWeights is not None


def _docs() -> list[tuple[str, str]]:
    """``(name, docstring)`` of each public name, and of DataParallel's public members."""
    found = [(n, inspect.getdoc(getattr(dp, n)) or "") for n in PUBLIC if n not in ALIASES]
    for member in WRAPPER_MEMBERS:
        raw = inspect.getattr_static(dp.DataParallel, member)
        found.append((f"DataParallel.{member}", pydoc.getdoc(raw)))
    return found


@pytest.mark.parametrize(("name", "doc"), _docs(), ids=[n for n, _ in _docs()])
def test_docstrings_name_nothing_a_user_cannot_import_or_open(name: str, doc: str) -> None:
    assert doc.strip(), f"{name}: no docstring"
    private = _PRIVATE.findall(doc)
    assert not private, f"{name}'s docstring names private modules or files: {private}"


@pytest.mark.parametrize("name", [n for n in PUBLIC if n not in ALIASES])
def test_every_public_docstring_has_its_sections(name: str) -> None:
    obj = getattr(dp, name)
    doc = inspect.getdoc(obj) or ""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = [p for p in inspect.signature(target).parameters if p not in ("self", "cls")]
    except (TypeError, ValueError):
        params = []
    needed = ["Example"]
    if params and name not in RECORDS:
        needed.append("Args:")
    if not inspect.isclass(obj):
        returns = str(inspect.signature(obj).return_annotation)
        if returns.startswith(("Iterator", "Generator")):
            needed.append("Yields:")
        elif returns != "None":
            needed.append("Returns:")
    if name not in RECORDS and "raises nothing" not in doc:  # (it says so, where it is so)
        needed.append("Raises:")
    absent = [section for section in needed if section not in doc]
    assert not absent, f"{name}'s docstring lacks {absent}"
    assert ">>>" in doc, f"{name}'s docstring has no example"


def _examples() -> list[tuple[str, Any]]:
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    tests = []
    for name in PUBLIC:
        obj = getattr(dp, name)
        if name in ALIASES:
            continue
        # each example imports what it uses (a user copies it into an empty session)
        for test in finder.find(obj, f"dataparallel.{name}", globs={}):
            if test.examples and test.name.split(".")[1] == name:
                tests.append((test.name, test))
    return tests


@pytest.mark.parametrize(("name", "test"), _examples(), ids=[n for n, _ in _examples()])
def test_public_examples_run(name: str, test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    output: list[str] = []
    runner.run(test, out=output.append)
    assert runner.failures == 0, "".join(output)


def test_every_public_name_has_an_example_that_runs() -> None:
    ran = {name.split(".")[1] for name, _ in _examples()}
    missing = [n for n in PUBLIC if n not in ALIASES and n not in ran]
    assert not missing, f"public names with no example: {missing}"


def test_help_of_the_wrapper_reads_as_its_own() -> None:
    text = pydoc.render_doc(dp.DataParallel, renderer=pydoc.plaintext)
    assert "Initialize internal Module state" not in text  # torch's __init__ text
    assert "StepMethod object" not in text
    for section in ("Args:", "Attributes:", "Raises:", "Example"):
        assert section in text, f"help(DataParallel) has no {section} section"
    attributes = text.split("Attributes:", 1)[1].split("Raises:", 1)[0]
    for name in ("scalars", "output_rules", "options", "scalar_weights", "last_call"):
        assert re.search(rf"\b{name}\b", attributes), f"{name} is not under Attributes"
    for step in ("train_step", "val_step", "test_step"):
        assert re.search(rf"^ \|  {step}\(.*\)\n \|      \S", text, re.M), step
    assert re.search(r"^ \|  last_call\n \|      \S", text, re.M), "last_call has no text"


@pytest.mark.parametrize("name", [n for n in PUBLIC if inspect.isclass(getattr(dp, n))])
def test_no_public_class_shows_torchs_constructor_text(name: str) -> None:
    text = pydoc.render_doc(getattr(dp, name), renderer=pydoc.plaintext)
    assert "Initialize internal Module state" not in text
