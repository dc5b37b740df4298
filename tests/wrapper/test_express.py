"""The express call (``dataparallel.wrapper._express``): a repeated call of one tensor, served
when nothing any gate of the warm call reads has changed since the last.

Oracle: the same module on one device, called with the same inputs after the same changes.
The generator draws sequences of calls of one signature with a change between calls, of every
kind the express must notice without a write to a dictionary it stamps (an argument of another
type, a tensor moved or made another dtype in place, the wrapper's device list written in place,
a class's forward replaced, tracing, a global hook) and of the kinds it sees through its stamps
(attributes, hooks, options, modes); each call is compared with the oracle, and the number of
calls the express served is checked against what the sequence allows. Named cases keep what
cannot be drawn: copies, pickles, compilation, a forward that writes on every call.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as torch_module

import dataparallel as dp
from _close import assert_close_rel
from dataparallel._common import stamps
from dataparallel.wrapper._express import MISS, Express

pytestmark = pytest.mark.skipif(not stamps.AVAILABLE, reason="the express call needs stamps")

FEATURES, OUT = 5, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, 8)
        self.head = nn.Linear(8, OUT)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x))) * self.scale


class Twice(Net):
    """A subclass whose forward the tests may replace on the class."""


def _twice_forward(self: Net, x: torch.Tensor) -> torch.Tensor:
    return Net.forward(self, x) * 2.0


def _thrice_forward(self: Net, x: torch.Tensor) -> torch.Tensor:
    return Net.forward(self, x) * 3.0


class _Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def served_by_express(w: dp.DataParallel, *args: Any) -> tuple[Any, bool]:
    """``w(*args)`` and whether the express call served it."""
    served = [False]
    real = Express.call

    def spy(self: Express, wrapper: Any, x: Any) -> Any:
        out = real(self, wrapper, x)
        served[0] = out is not MISS
        return out

    with mock.patch.object(Express, "call", spy):
        out = w(*args)
    return out, served[0]


def _fresh(devices: list[str] | None = None) -> tuple[Twice, Twice, dp.DataParallel]:
    torch.manual_seed(0)
    model = Twice()
    oracle = copy.deepcopy(model)
    return model, oracle, dp.DataParallel(model, devices or ["cpu", "cpu"])


def _armed(w: dp.DataParallel, x: torch.Tensor) -> None:
    for _ in range(3):
        w(x)
    assert served_by_express(w, x)[1], "the third identical call is served by the express"


# -- the generator -------------------------------------------------------------------------

# "missing" changes: the express must not serve the next call; "seen" ones: a stamped write,
# after which the next call misses and the one after is served again; "none": nothing.
CHANGES = (
    "none",
    "attr",
    "hook",
    "eval",
    "option",
    "class_forward",
    "devices_in_place",
    "double_in_place",
    "subclass_arg",
    "bigger_batch",
    "class_assigned",
)


# Changes the express must see. The others leave every answer as it was: a parameter's data
# of another dtype (``p.data = ...``) reaches the replicas, which share the Parameter objects.
MUST_MISS = frozenset(CHANGES) - {"none", "double_in_place"}


def _apply(change: str, model: Twice, oracle: Twice, w: dp.DataParallel) -> None:
    if change == "attr":
        model.scale = oracle.scale = model.scale + 0.5
    elif change == "hook":
        for m in (model, oracle):
            m.head.register_forward_hook(lambda mod, inp, out: out - 0.25)
    elif change == "eval":
        for m in (model, oracle):
            m.train(not m.training)
    elif change == "option":
        w.max_size = None if w.max_size is not None else 64
    elif change == "class_forward":
        now = vars(Twice).get("forward")
        Twice.forward = _thrice_forward if now is _twice_forward else _twice_forward  # type: ignore[method-assign]
    elif change == "devices_in_place":
        w.device_ids.append(torch.device("cpu")) if len(w.device_ids) < 3 else w.device_ids.pop()
    elif change == "class_assigned":  # no table written: the head's class itself
        for m in (model, oracle):
            m.head.__class__ = nn.Linear if type(m.head) is _Doubled else _Doubled
    elif change == "double_in_place":  # same Parameter objects, their data another dtype
        with torch.no_grad():
            for m in (model, oracle):
                for p in m.parameters():
                    p.data = p.data.to(torch.float64 if p.dtype == torch.float32 else torch.float32)


class _Marked(torch.Tensor):
    """A tensor subclass: not the plain tensor the express serves."""


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(changes=st.lists(st.sampled_from(CHANGES), min_size=1, max_size=8))
def test_generated_changes_between_express_calls_match_one_device(changes: list[str]) -> None:
    model, oracle, w = _fresh()
    gen = torch.Generator().manual_seed(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(3):  # armed and served
                x = torch.randn(6, FEATURES, generator=gen)
                assert_close_rel(w(x), oracle(x), msg=f"call {i}")
            for i, change in enumerate(changes):
                _apply(change, model, oracle, w)
                dtype = next(model.parameters()).dtype
                batch = 9 if change == "bigger_batch" else 6
                x = torch.randn(batch, FEATURES, generator=gen, dtype=dtype)
                if change == "subclass_arg":
                    x = x.as_subclass(_Marked)
                out, served = served_by_express(w, x)
                ref = oracle(x.as_subclass(torch.Tensor))
                assert_close_rel(out.as_subclass(torch.Tensor), ref, msg=f"{changes} at {i}")
                if change in MUST_MISS:
                    assert not served, f"{change}: the express served the call after it"
                x = torch.randn(6, FEATURES, generator=gen, dtype=dtype)
                out, served = served_by_express(w, x)
                assert_close_rel(out, oracle(x), msg=f"{changes} after {i}")
    finally:
        if "forward" in vars(Twice):
            del Twice.forward


# -- named cases ---------------------------------------------------------------------------


def test_a_forward_that_writes_on_every_call_stops_arming_and_stays_right() -> None:
    class Counting(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x) + self.calls

    torch.manual_seed(0)
    model = Counting()
    oracle = copy.deepcopy(model)
    w = dp.DataParallel(model, ["cpu", "cpu"])
    x = torch.randn(6, FEATURES)
    with torch.no_grad():
        for i in range(8):
            out, served = served_by_express(w, x)
            assert not served, f"call {i}"
            # replica 0 is the module: its write is the one the oracle makes; replica 1's
            # own copy counts its calls too, as torch's replicas would not: compare rows 0-2
            assert_close_rel(out[:3], oracle(x)[:3], msg=f"call {i}")
    assert w.__dict__.get("_express") is None  # given up: the warm path serves the calls


def test_global_module_hooks_between_express_calls() -> None:
    _model, oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    handle = torch_module.register_module_forward_hook(
        lambda m, i, o: o * 3.0 if isinstance(m, nn.Linear) else o
    )
    try:
        out, served = served_by_express(w, x)
        assert not served
        assert_close_rel(out, oracle(x))
    finally:
        handle.remove()
    out, served = served_by_express(w, x)
    assert not served
    assert_close_rel(out, oracle(x))


def test_jit_trace_of_an_armed_wrapper_goes_through_torch() -> None:
    _model, oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(w, (x,), check_trace=False)
        assert_close_rel(traced(x), oracle(x))


def test_copies_and_pickles_of_an_armed_wrapper_start_without_its_express() -> None:
    _model, oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    for other in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
        assert "_express" not in other.__dict__
        assert_close_rel(other(x), oracle(x))
        assert_close_rel(other(x), oracle(x))
    # the original's express still serves, and its module is still its own
    out, served = served_by_express(w, x)
    assert served
    assert_close_rel(out, oracle(x))


def test_an_express_moved_to_another_wrapper_is_not_used() -> None:
    model, _oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    other = dp.DataParallel(copy.deepcopy(model), ["cpu", "cpu"])
    with torch.no_grad():
        for p in other.module.parameters():
            p.mul_(2.0)
    other.__dict__["_express"] = w.__dict__["_express"]  # by hand, past every API
    out, served = served_by_express(other, x)
    assert not served
    assert_close_rel(out, other.module(x))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_after_arming_gets_the_general_paths_answer() -> None:
    """A strided nested tensor has no shape to read: the express steps aside, and the error
    is the one a wrapper that never armed gives."""
    model, _oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    nested = torch.nested.nested_tensor([torch.randn(2, FEATURES), torch.randn(3, FEATURES)])
    with pytest.raises(Exception) as fresh:
        dp.DataParallel(copy.deepcopy(model), ["cpu", "cpu"])(nested)
    with pytest.raises(type(fresh.value)) as raised:
        w(nested)
    assert str(raised.value) == str(fresh.value)


def test_module_moved_to_another_dtype_with_swapped_tensors() -> None:
    """``module.to()`` under ``swap_module_params_on_conversion`` keeps every Parameter object
    (and so every table) and swaps its contents: no stamp moves, and the calls after it are
    still one device's."""
    model, oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
        oracle.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    x = x.double()
    for _ in range(3):
        assert_close_rel(w(x), oracle(x))


def test_keyword_only_warm_calls_are_not_armed_and_match_one_device() -> None:
    """A call of keywords only (``model(**batch)``) has no positional tensor: its warm calls
    run as before, with no express (found by the transformers integration tests)."""
    _model, oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    for _ in range(4):
        assert_close_rel(w(x=x), oracle(x=x))
    assert "_express" not in w.__dict__


def test_a_method_patched_on_the_wrapper_class_is_not_skipped() -> None:
    """A method of ``DataParallel`` replaced on the class (found by a review: the express call
    served the next call past it): the class's namespace is stamped too."""
    _model, _oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    real = dp.DataParallel._pipeline
    try:
        dp.DataParallel._pipeline = lambda self, *a, **k: real(self, *a, **k) + 100.0  # type: ignore[method-assign]
        out, served = served_by_express(w, x)
        assert not served
        assert_close_rel(out, w.forward(x))
    finally:
        dp.DataParallel._pipeline = real  # type: ignore[method-assign]


class _Negated(Twice):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -super().forward(x)


@pytest.mark.parametrize("where", ["submodule", "root"])
def test_a_class_assigned_between_calls_is_seen(where: str) -> None:
    """``module.__class__ = Other`` writes no table (found by a review, and there before the
    express call: replica 1 kept the old class): each module's class is compared on every
    call, and a new one rebuilds the replicas."""
    model, oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    for m in (model, oracle):
        if where == "submodule":
            m.head.__class__ = _Doubled
        else:
            m.__class__ = _Negated
    for _ in range(3):
        assert_close_rel(w(x), oracle(x))


def test_a_dictionary_assigned_between_calls_is_seen() -> None:
    """``obj.__dict__ = {...}`` on a module or on the wrapper: the stamps watch the old
    dictionary, so each dictionary object is compared on every call."""
    model, oracle, w = _fresh()
    x = torch.randn(6, FEATURES)
    _armed(w, x)
    for m in (model, oracle):
        new = dict(m.head.__dict__)
        new["_parameters"] = {
            k: nn.Parameter(p.detach() * 2.0) for k, p in m.head._parameters.items()
        }
        m.head.__dict__ = new
    for _ in range(3):
        assert_close_rel(w(x), oracle(x))
    _armed(w, x)
    w.__dict__ = dict(w.__dict__)  # the express goes along, watching the old dictionary
    w.__dict__["gather_outputs"] = False
    out, served = served_by_express(w, x)
    assert not served
    assert not isinstance(out, torch.Tensor)  # per-device outputs, as the option says


def test_an_armed_wrapper_is_freed_without_the_collector() -> None:
    """Deleting a wrapper whose express call is armed frees the wrapper, its module and its
    replicas at once, with the collector off: the express holds no reference back to the
    wrapper's dictionary, its step holds it weakly, and the kept tasks hold the step's check
    weakly (that last cycle, between the warm step and its kept tasks, was there before the
    express call and kept a deleted wrapper's module alive until the collector ran)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        model, _oracle, w = _fresh()
        x = torch.randn(6, FEATURES)
        _armed(w, x)
        refs = [weakref.ref(o) for o in (model, w, w.__dict__["_express"])]
        del model, w, _oracle
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()
