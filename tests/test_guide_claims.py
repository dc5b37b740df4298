"""Claims of docs/guide.md that did not hold, or held where users would not look (issue 42,
items 5 and 6), each checked as a user would meet it, against the plain module where there is
a result to compare."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
CPU2 = ["cpu", "cpu"]


# ------------------------------------------------------------------ strict takes a bool


@pytest.mark.parametrize("value", ["yes", "no", 1, 0, None])
def test_strict_that_is_not_a_bool_is_refused_everywhere(value: Any) -> None:
    x = torch.randn(4, 3)
    calls = [
        lambda: dp.plan((x,), None, CPU2, strict=value),
        lambda: dp.scatter((x,), CPU2, strict=value),
        lambda: dp.DataParallel(nn.Linear(3, 2), CPU2, strict=value),
        lambda: dp.data_parallel(nn.Linear(3, 2), x, CPU2, strict=value),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"^strict: expected True or False, got"):
            call()
    wrapper = dp.DataParallel(nn.Linear(3, 2), CPU2)
    with pytest.raises(TypeError, match=r"^strict: expected True or False"):
        wrapper.strict = value
    assert wrapper.strict is False


def test_strict_true_and_false_keep_their_meaning() -> None:
    x, other = torch.randn(4, 3), torch.randn(3, 3)
    with pytest.raises(ValueError, match=r"args\[1\].*strict=True"):
        dp.plan((x, other), None, CPU2, strict=True)
    with pytest.warns(UserWarning, match=r"args\[1\]"):
        dp.scatter((x, other), CPU2, strict=False)


# ------------------------------------------------------------ the device check and 'meta'


def test_a_module_on_meta_is_refused_without_suggesting_meta() -> None:
    model = dp.DataParallel(nn.Linear(3, 2).to("meta"), CPU2)
    with pytest.raises(RuntimeError) as caught:
        model(torch.randn(4, 3))
    message = str(caught.value)
    assert "found 'weight' on the meta device" in message and "to_empty(device='cpu')" in message
    assert "first in device_ids" not in message  # 'meta' is refused there
    with pytest.raises(ValueError, match="meta"):
        dp.DataParallel(nn.Linear(3, 2), ["meta", "cpu"])


# ------------------------------------------------------------------------- lazy modules


def test_lazy_modules_are_refused_at_the_first_replicating_call() -> None:
    torch.manual_seed(0)
    lazy = nn.LazyLinear(2)
    model = dp.DataParallel(lazy, CPU2)  # construction accepts it (the guide says so)
    with pytest.raises(ValueError, match=r"uninitialized \(lazy\).*run one forward"):
        model(torch.randn(4, 3))
    one = dp.DataParallel(lazy, ["cpu"])
    x = torch.randn(4, 3)
    out = one(x)  # one device: the module as itself, which initialises it
    assert_close_rel(out, lazy(x))
    assert_close_rel(model(x), lazy(x))  # initialised: every device list runs it


# ------------------------------------------------------------ one nesting rule for all


def _nested(levels: int, wrap: Any) -> Any:
    obj: Any = torch.randn(4, 3)
    for _ in range(levels):
        obj = wrap(obj)
    return obj


@pytest.mark.parametrize(
    "wrap",
    [lambda o: [o], lambda o: {"k": o}, lambda o: (o,), lambda o: [o, 1]],
    ids=["list", "dict", "tuple", "mixed-list"],
)
@pytest.mark.parametrize("levels", [100, 101, 150])
def test_plan_scatter_explain_and_the_wrapper_share_one_nesting_rule(
    wrap: Any, levels: int
) -> None:
    def outcome(call: Any) -> bool:
        try:
            call()
        except ValueError as exc:
            assert "nested more than 100 levels deep" in str(exc), exc
            return False
        return True

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a sequence of 1 beside a batch of 4 warns)
        found = {
            "plan": outcome(lambda: dp.plan((_nested(levels, wrap),), None, CPU2)),
            "scatter": outcome(lambda: dp.scatter((_nested(levels, wrap),), CPU2)),
            "explain": outcome(
                lambda: dp.DataParallel(nn.Identity(), CPU2).explain(_nested(levels, wrap))
            ),
            "wrapper": outcome(lambda: dp.DataParallel(nn.Identity(), CPU2)(_nested(levels, wrap))),
            "shared": outcome(lambda: dp.plan((dp.Shared(_nested(levels, wrap)),), None, CPU2)),
        }
    assert set(found.values()) == {levels <= 100}, found


# ---------------------------------------------------------- the constructor's signature


def test_the_guides_constructor_signature_is_the_constructors() -> None:
    text = " ".join(GUIDE.read_text(encoding="utf-8").split())
    match = re.search(r"`dp\.DataParallel\((module, device_ids=None.*?)\)` is a", text)
    assert match, "the guide's constructor signature was not found"
    written = [p.strip() for p in match.group(1).split(",")]
    expected: list[str] = []
    for p in inspect.signature(dp.DataParallel).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in expected:
            expected.append("*")
        default = "" if p.default is p.empty else f"={p.default!r}".replace("'", '"')
        expected.append(f"{p.name}{default}")
    assert written == expected


# -------------------------------------------------- DataParallelCriterion and reductions


@pytest.mark.parametrize("devices", [CPU2, ["cpu", "cpu:1", "cpu:1"]], ids=str)
def test_a_sum_reduced_criterion_is_the_exact_total(devices: list[str]) -> None:
    torch.manual_seed(1)
    lin = nn.Linear(4, 3)
    x, y = torch.randn(11, 4), torch.randint(0, 3, (11,))
    outputs = dp.DataParallel(lin, devices, gather=False)(x)
    for loss in (nn.CrossEntropyLoss(reduction="sum"), nn.MSELoss(reduction="sum")):
        target = y if isinstance(loss, nn.CrossEntropyLoss) else torch.randn(11, 3)
        got = dp.DataParallelCriterion(loss, devices)(outputs, target)
        assert_close_rel(got, loss(lin(x), target))  # the total, not a chunk-weighted mean


# ------------------------------------------------------ booleans under scalars="stack"


class Flags(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.sum() > 0).reshape(())


def test_scalars_stack_keeps_booleans_apart_and_output_rules_stacks_them() -> None:
    x = torch.tensor([[1.0], [-1.0]])  # chunk 0 says True, chunk 1 False
    with pytest.raises(ValueError, match=r"different booleans.*'all'.*'any'"):
        dp.DataParallel(Flags(), CPU2, scalars="stack")(x)
    out = dp.DataParallel(Flags(), CPU2, output_rules={"output": "stack"})(x)
    assert out.tolist() == [True, False]


# ------------------------------------- an integer computed from a buffer is a count


class Step(nn.Module):
    step: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.tensor(5))

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"computed": self.step * 1, "buffer": self.step, "constant": 5, "y": x}


@pytest.mark.parametrize("devices", [CPU2, ["cpu", "cpu:1", "cpu:1"]], ids=str)
def test_an_integer_computed_from_a_buffer_is_summed_as_the_guide_says(
    devices: list[str],
) -> None:
    out = dp.DataParallel(Step(), devices)(torch.randn(2 * len(devices), 3))
    assert int(out["computed"]) == 5 * len(devices)  # a count: one per replica, summed
    assert int(out["buffer"]) == 5 and out["constant"] == 5  # received / a constant: once
