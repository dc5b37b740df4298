"""``replicate._compiled``: a compiled module is refused on two or more replicas, with the fix,
and accepted on one (the module is its own replica)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dataparallel.replicate._compiled import check_not_compiled, compiled_class

ONE = [torch.device("cpu")]
TWO = [torch.device("cpu")] * 2


def test_an_eager_module_passes_on_any_device_list() -> None:
    check_not_compiled(nn.Linear(2, 2), TWO)


def test_a_module_compiled_in_place_is_refused_on_two_replicas_only() -> None:
    module = nn.Linear(2, 2)
    module.compile()  # stores a compiled call bound to this very module
    check_not_compiled(module, ONE)
    with pytest.raises(TypeError, match=r"compiled in place.*torch\.compile\(dp\.DataParallel"):
        check_not_compiled(module, TWO)


def test_a_torch_compile_result_is_refused_and_its_class_is_found() -> None:
    compiled = torch.compile(nn.Linear(2, 2))
    cls = compiled_class()
    assert cls is not None and isinstance(compiled, cls)
    check_not_compiled(compiled, ONE)
    with pytest.raises(TypeError, match=r"OptimizedModule.*_orig_mod"):
        check_not_compiled(compiled, TWO)
