"""The oracle: the same module on one device is the reference for outputs, loss, gradients
and optimizer steps."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

import dataparallel as dp

ATOL = 1e-5
# (devices, batch size): shared parameters on one device; and a "second" CPU device, whose
# replicas get differentiable copies of the parameters, with an uneven batch.
LAYOUTS = [
    pytest.param(["cpu", "cpu"], 5, id="2x-cpu-b5"),
    pytest.param(["cpu", "cpu:1", "cpu:1"], 7, id="3x-cpu1-b7"),
]

# The largest difference from one device each case measured (printed with DP_REPORT_DIFFS=1).
DIFFS: dict[str, float] = {}


def record(case: str, diff: float) -> None:
    DIFFS[case] = max(DIFFS.get(case, 0.0), diff)


def compare(ref: Any, out: Any, path: str = "output", atol: float = ATOL) -> float:
    """Assert ``out`` matches ``ref`` (types, structure, values); the largest difference."""
    if isinstance(ref, PackedSequence):
        assert isinstance(out, PackedSequence), f"{path}: {type(out).__name__}"
        (rp, rl), (op, ol) = pad_packed_sequence(ref, True), pad_packed_sequence(out, True)
        assert torch.equal(rl, ol), f"{path}: lengths {rl} != {ol}"
        return compare(rp, op, path + ".padded", atol)
    assert type(out) is type(ref), f"{path}: {type(out).__name__} != {type(ref).__name__}"
    if isinstance(ref, torch.Tensor):
        assert out.shape == ref.shape, f"{path}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
        assert out.dtype == ref.dtype, f"{path}: dtype {out.dtype} != {ref.dtype}"
        if not ref.is_floating_point():
            assert torch.equal(out, ref), path
            return 0.0
        diff = (out.detach() - ref.detach()).abs().max().item() if ref.numel() else 0.0
        assert diff <= atol, f"{path}: differs by {diff}"
        return diff
    if isinstance(ref, Mapping):
        assert list(out.keys()) == list(ref.keys()), f"{path}: keys"
        return max([compare(ref[k], out[k], f"{path}[{k!r}]", atol) for k in ref] or [0.0])
    if isinstance(ref, (list, tuple)):
        assert len(out) == len(ref), f"{path}: length {len(out)} != {len(ref)}"
        parts = [
            compare(r, o, f"{path}[{i}]", atol)
            for i, (r, o) in enumerate(zip(ref, out, strict=True))
        ]
        return max(parts or [0.0])
    if dataclasses.is_dataclass(ref):
        names = [f.name for f in dataclasses.fields(ref)]
        return max(
            [compare(getattr(ref, n), getattr(out, n), f"{path}.{n}", atol) for n in names] or [0.0]
        )
    assert out == ref, f"{path}: {out!r} != {ref!r}"
    return 0.0


def compare_grads(ref: nn.Module, par: nn.Module, atol: float = ATOL) -> float:
    """Every parameter's gradient (and whether it has one) matches; the largest difference."""
    worst = 0.0
    pairs = zip(ref.named_parameters(), par.named_parameters(), strict=True)
    for (name, p), (name2, q) in pairs:
        assert name == name2
        assert (p.grad is None) == (q.grad is None), f"{name}: grad {p.grad is None}"
        if p.grad is not None:
            worst = max(worst, compare(p.grad, q.grad, f"{name}.grad", atol))
    return worst


def check(
    case: str,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_of: Callable[[Any], torch.Tensor],
    devices: list[str],
    *,
    steps: int = 3,
    wrap: Callable[[nn.Module, list[str]], Callable[..., Any]] | None = None,
    atol: float = ATOL,
    compare_outputs: Callable[[Any, Any], float] | None = None,
) -> tuple[nn.Module, nn.Module]:
    """Train ``model`` on one device and a copy through DataParallel, ``steps`` SGD steps on
    the same batch, comparing outputs, loss, every gradient and the parameters after each step.

    Returns the reference and the wrapped copy (for checks of their state).
    """
    torch.manual_seed(0)
    par = copy.deepcopy(model)
    run = wrap(par, devices) if wrap else dp.DataParallel(par, devices)
    opt_ref = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    opt_par = torch.optim.SGD([p for p in par.parameters() if p.requires_grad], lr=0.1)
    worst = 0.0
    for _ in range(steps):
        opt_ref.zero_grad()
        opt_par.zero_grad()
        out_ref = model(*args, **kwargs)
        out_par = run(*args, **kwargs)
        if compare_outputs is not None:
            worst = max(worst, compare_outputs(out_ref, out_par))
        else:
            worst = max(worst, compare(out_ref, out_par, atol=atol))
        loss_ref, loss_par = loss_of(out_ref), loss_of(out_par)
        assert loss_par.dim() == 0
        worst = max(worst, compare(loss_ref, loss_par, "loss", atol))
        loss_ref.backward()
        loss_par.backward()
        worst = max(worst, compare_grads(model, par, atol))
        opt_ref.step()
        opt_par.step()
        for (name, p), q in zip(model.named_parameters(), par.parameters(), strict=True):
            worst = max(worst, compare(p, q, name, atol))
    record(case, worst)
    return model, par
