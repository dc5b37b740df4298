"""The wrapper presents the wrapped module's call signature to introspection
(``dataparallel.wrapper._signature``), without a cycle, a slower call, or a change to what runs."""

from __future__ import annotations

import copy
import gc
import inspect
import pickle
import weakref

import torch
from torch import nn

import dataparallel as dp

CPU2 = ["cpu", "cpu"]


class Keywords(nn.Module):
    """A forward in the shape of a transformers model's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: int
    ) -> torch.Tensor:
        return self.lin(input_ids)


class NoSignature(nn.Module):
    forward = staticmethod(torch.relu)  # a builtin: inspect cannot read it


def test_forward_and_instance_name_the_module_parameters() -> None:
    module = Keywords()
    wrapper = dp.DataParallel(module, CPU2)
    expected = inspect.signature(module.forward)
    assert list(expected.parameters) == ["input_ids", "attention_mask", "kwargs"]
    assert inspect.signature(wrapper.forward) == expected
    assert inspect.signature(wrapper) == expected
    # what signature-driven code does with it: bind a call, as the module would
    bound = inspect.signature(wrapper.forward).bind(torch.ones(4, 3), attention_mask=None)
    assert list(bound.arguments) == ["input_ids", "attention_mask"]
    out = wrapper(*bound.args, **bound.kwargs)
    torch.testing.assert_close(out, module(torch.ones(4, 3)))


def test_the_class_keeps_its_own_signatures() -> None:
    """The class is not an instance: its __init__ and its plain forward function."""
    assert "device_ids" in inspect.signature(dp.DataParallel).parameters
    assert isinstance(dp.DataParallel.forward, type(test_the_class_keeps_its_own_signatures))
    assert (
        str(inspect.signature(dp.DataParallel.forward))
        == "(self, *inputs: 'Any', **kwargs: 'Any') -> 'Any'"
    )


def test_the_signature_follows_the_current_module() -> None:
    wrapper = dp.DataParallel(nn.Linear(3, 2), CPU2)
    assert list(inspect.signature(wrapper.forward).parameters) == ["input"]
    wrapper.module = Keywords()
    assert "attention_mask" in inspect.signature(wrapper.forward).parameters


def test_a_module_without_a_readable_signature_gives_the_wrappers() -> None:
    wrapper = dp.DataParallel(NoSignature(), CPU2)
    assert str(inspect.signature(wrapper.forward)) == "(*inputs: 'Any', **kwargs: 'Any') -> 'Any'"
    torch.testing.assert_close(wrapper(-torch.ones(4, 2)), torch.zeros(4, 2))


def test_nested_wrappers_present_the_innermost_module() -> None:
    inner = dp.DataParallel(Keywords(), ["cpu"])
    outer = dp.DataParallel(inner, ["cpu"])
    assert inspect.signature(outer.forward) == inspect.signature(inner.module.forward)


def test_a_subclass_forward_is_its_own() -> None:
    class Doubled(dp.DataParallel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    module = Keywords()
    wrapper = Doubled(module, CPU2)
    assert list(inspect.signature(wrapper.forward).parameters) == ["x"]
    assert list(inspect.signature(wrapper).parameters) == ["x"]
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapper(x), module(x) * 2)


def test_copies_and_pickles_present_their_own_module() -> None:
    wrapper = dp.DataParallel(Keywords(), CPU2)
    wrapper(torch.randn(4, 3))  # the per-instance forward exists now
    for other in (copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper))):
        assert inspect.signature(other.forward) == inspect.signature(wrapper.forward)
        other.module = nn.Linear(3, 2)  # its own module, not the original's
        assert list(inspect.signature(other.forward).parameters) == ["input"]
        assert other(torch.randn(4, 3)).shape == (4, 2)
    assert "attention_mask" in inspect.signature(wrapper.forward).parameters


def test_a_dropped_wrapper_is_freed_at_once() -> None:
    """The per-instance forward holds the wrapper weakly: no reference cycle."""
    gc.collect()
    gc.disable()
    try:
        module = Keywords()
        wrapper = dp.DataParallel(module, CPU2)
        wrapper(torch.randn(4, 3))
        inspect.signature(wrapper.forward)
        refs = [weakref.ref(wrapper), weakref.ref(module)]
        del wrapper, module
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
