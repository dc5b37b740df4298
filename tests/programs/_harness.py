"""Run a ported program on one device and through the wrapper, and compare everything.

A program (one module of this folder) is a public training script ported by swapping
``torch.nn.DataParallel`` for ``dp.DataParallel``, minimised: its own model code and step, tiny
sizes, a few steps on synthetic data of the right shapes. It defines:

- ``build() -> nn.Module``: the model, from a fixed seed;
- ``batches() -> list``: the steps' inputs;
- ``step(model, run, batch, optimizers, memo) -> dict[str, Tensor]``: one training step as
  the script takes it, ``run`` being what the script calls (the model itself on one device,
  its wrapper here), ``memo`` a dict kept between the steps of one run (an RNN's hidden
  state); it returns what the step computed (losses, outputs);
- or, for a script whose loop is a trainer's (transformers' ``Trainer``), ``run_all(model,
  run, folder) -> dict``: the whole run, whatever it reports (logged losses, metrics,
  predictions);
- optionally ``optimizers(model)``, ``wrap(model, devices)`` (its own wrapper class or
  options, or several wrappers), ``plain(model)`` (what ``wrap`` stands for on one device:
  the model by default) and ``ATTRIBUTES`` (plain attributes its forward writes).

``check(program, devices)`` runs the same steps on a copy of the model through the wrapper
and asserts that every figure of every step, and the model's parameters, buffers and written
attributes after the last step, are the one-device run's (relative to their magnitude). With
``one_device="raise"`` the wrappers are built under ``DATAPARALLEL_CHECK=raise``, so the
library's own comparison (``check=``) runs too and must find nothing, and must leave the run as
it is without it; ``differences(program, devices)`` returns what ``check=True`` reports of a
program known to differ.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

__all__ = ["LISTS", "check", "differences"]

LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


def _optimizers(program: ModuleType, model: nn.Module) -> list[torch.optim.Optimizer]:
    make = getattr(program, "optimizers", None)
    if make is not None:
        return list(make(model))
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]


def _run(program: ModuleType, model: nn.Module, run: Any) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(1234)  # the same draws (noise, interpolation weights) on both runs
    opts = _optimizers(program, model)
    memo: dict[str, Any] = {}
    return [program.step(model, run, batch, opts, memo) for batch in program.batches()]


@contextlib.contextmanager
def _checking(mode: str | None) -> Iterator[None]:
    """``DATAPARALLEL_CHECK=mode`` while the wrappers are built and run (a program's ``wrap``
    and a trainer's own wrapping alike); a give-up of the check is an error here."""
    if mode is None:
        yield
        return
    saved = os.environ.get("DATAPARALLEL_CHECK")
    os.environ["DATAPARALLEL_CHECK"] = mode
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield
    finally:
        if saved is None:
            del os.environ["DATAPARALLEL_CHECK"]
        else:
            os.environ["DATAPARALLEL_CHECK"] = saved
    gave_up = [
        str(w.message)
        for w in seen
        if str(w.message).startswith("check=: ") and w.category is not dp.OneDeviceDifference
    ]
    assert not gave_up, f"check= checked nothing: {gave_up[0]}"
    for w in seen:  # the others, as they would have been shown
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def check(program: ModuleType, devices: list[str], *, one_device: str | None = None) -> None:
    """The program through ``dp.DataParallel`` on ``devices`` is its one-device run; with
    ``one_device``, the wrappers' ``check=`` runs too (``_checking``)."""
    ref = program.build()
    model = copy.deepcopy(ref)
    plain = getattr(program, "plain", None)
    one = ref if plain is None else plain(ref)
    if hasattr(program, "run_all"):
        with tempfile.TemporaryDirectory() as folder:
            torch.manual_seed(1234)
            want = [program.run_all(ref, one, Path(folder, "one"))]
            torch.manual_seed(1234)
            with _checking(one_device):
                got = [program.run_all(model, _wrap(program, model, devices), Path(folder, "par"))]
    else:
        want = _run(program, ref, one)
        with _checking(one_device):
            got = _run(program, model, _wrap(program, model, devices))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), f"step {i}: {sorted(a)} != {sorted(b)}"
        for key in b:
            _same(a[key], b[key], f"step {i}: {key}")
    theirs, mine = ref.state_dict(), model.state_dict()
    assert theirs.keys() == mine.keys()
    for key, value in theirs.items():
        assert_close_rel(mine[key], value, msg=f"after the steps: {key}")
    for path in getattr(program, "ATTRIBUTES", ()):
        a, b = _attribute(model, path), _attribute(ref, path)
        assert a == b, f"after the steps: {path} is {a!r}, one device's {b!r}"


def _wrap(program: ModuleType, model: nn.Module, devices: list[str]) -> Any:
    wrap = getattr(program, "wrap", None)
    return wrap(model, devices) if wrap is not None else dp.DataParallel(model, devices)


def differences(program: ModuleType, devices: list[str]) -> list[str]:
    """What ``check=True`` reports (``dp.OneDeviceDifference``) over the program's steps."""
    model = program.build()
    saved = os.environ.get("DATAPARALLEL_CHECK")
    os.environ["DATAPARALLEL_CHECK"] = "1"
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _run(program, model, _wrap(program, model, devices))
    finally:
        if saved is None:
            del os.environ["DATAPARALLEL_CHECK"]
        else:
            os.environ["DATAPARALLEL_CHECK"] = saved
    return [str(w.message) for w in seen if issubclass(w.category, dp.OneDeviceDifference)]


def _same(got: Any, want: Any, where: str) -> None:
    """Tensors and arrays relative to their magnitude; numbers to 1e-5 relative; lists item by
    item; anything else equal."""
    if isinstance(want, np.ndarray):
        want, got = torch.from_numpy(want), torch.from_numpy(np.asarray(got))
    if isinstance(want, torch.Tensor):
        assert_close_rel(got, want, msg=where)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} items, one device's {len(want)}"
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            _same(a, b, f"{where}[{k}]")
    elif isinstance(want, float):
        same = math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7)
        assert same or (math.isnan(got) and math.isnan(want)), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _attribute(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj
