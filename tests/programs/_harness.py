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
attributes after the last step, are the one-device run's (relative to their magnitude).
"""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

__all__ = ["LISTS", "check"]

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


def check(program: ModuleType, devices: list[str]) -> None:
    """The program through ``dp.DataParallel`` on ``devices`` is its one-device run."""
    ref = program.build()
    model = copy.deepcopy(ref)
    wrap = getattr(program, "wrap", None)
    wrapper = wrap(model, devices) if wrap is not None else dp.DataParallel(model, devices)
    plain = getattr(program, "plain", None)
    one = ref if plain is None else plain(ref)
    if hasattr(program, "run_all"):
        with tempfile.TemporaryDirectory() as folder:
            torch.manual_seed(1234)
            want = [program.run_all(ref, one, Path(folder, "one"))]
            torch.manual_seed(1234)
            got = [program.run_all(model, wrapper, Path(folder, "par"))]
    else:
        want = _run(program, ref, one)
        got = _run(program, model, wrapper)
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
