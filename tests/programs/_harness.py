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
- optionally ``optimizers(model)``, ``wrap(model, devices)`` (its own wrapper class or
  options, or several wrappers), ``plain(model)`` (what ``wrap`` stands for on one device:
  the model by default) and ``ATTRIBUTES`` (plain attributes its forward writes).

``check(program, devices)`` runs the same steps on a copy of the model through the wrapper
and asserts that every figure of every step, and the model's parameters, buffers and written
attributes after the last step, are the one-device run's (relative to their magnitude).
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

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
    want = _run(program, ref, ref if plain is None else plain(ref))
    got = _run(program, model, wrapper)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), f"step {i}: {sorted(a)} != {sorted(b)}"
        for key in b:
            assert_close_rel(a[key], b[key], msg=f"step {i}: {key}")
    theirs, mine = ref.state_dict(), model.state_dict()
    assert theirs.keys() == mine.keys()
    for key, value in theirs.items():
        assert_close_rel(mine[key], value, msg=f"after the steps: {key}")
    for path in getattr(program, "ATTRIBUTES", ()):
        a, b = _attribute(model, path), _attribute(ref, path)
        assert a == b, f"after the steps: {path} is {a!r}, one device's {b!r}"


def _attribute(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj
