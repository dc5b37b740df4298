"""``dataparallel.replicate._compiled``: a module compiled as a whole is not replicated.

A ``torch.compile`` result's forward is bound to the original module, so replicas of it would
all run that one module; ``DataParallel`` refuses it over two or more replicas and names the
fix, and accepts it on one (the module itself runs, as on one device).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.replicate._compiled import check_not_compiled, compiled_class

CPU2 = [torch.device("cpu")] * 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_a_torch_compile_result_is_refused_over_two_replicas() -> None:
    compiled = torch.compile(_model(), backend="eager")
    assert compiled_class() is type(compiled)
    with pytest.raises(TypeError, match=r"torch\.compile\(\.\.\.\) result") as info:
        dp.DataParallel(compiled, CPU2)
    assert "torch.compile(dp.DataParallel(model))" in str(info.value)
    assert "over 2 replicas" in str(info.value)


def test_a_module_compiled_in_place_is_refused_over_two_replicas() -> None:
    model = _model()
    model.compile(backend="eager")
    with pytest.raises(TypeError, match=r"compiled in place with module\.compile\(\)"):
        dp.DataParallel(model, CPU2)


def test_a_module_compiled_after_wrapping_is_refused_at_the_next_call() -> None:
    model = _model()
    wrapper = dp.DataParallel(model, CPU2)
    x = torch.randn(6, 4)
    wrapper(x)
    model.compile(backend="eager")
    with pytest.raises(TypeError, match="compiled in place"):
        wrapper(x)


def test_one_replica_runs_the_compiled_module_as_on_one_device() -> None:
    model = _model()
    x = torch.randn(6, 4)
    expected = model(x)
    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(dp.DataParallel(compiled, ["cpu"])(x), expected)


def test_eager_modules_and_compiled_children_pass() -> None:
    model = _model()
    check_not_compiled(model, CPU2)
    model[0] = torch.compile(model[0], backend="eager")  # a child: each replica copies it
    check_not_compiled(model, CPU2)
