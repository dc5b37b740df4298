"""Options set on a built wrapper are checked as the constructor checks them (issue 29, item 8).

``w.scalars = "summ"`` or ``w.output_rules = {"output[1]": "summ"}`` used to be kept and
silently read as ``"mean"``; the batch options set as attributes (``w.max_size = 4``) were
ignored. Every option the constructor validates is validated on assignment too, with the
constructor's message, and a valid assignment takes effect at the next call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

CPU2 = ["cpu", "cpu"]

BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("scalars", "summ", ValueError, r"^scalars: expected one of"),
    ("output_rules", {"output[1]": "summ"}, ValueError, r"^output_rules\['output\[1\]'\]"),
    ("output_rules", ["output[0]"], TypeError, r"^output_rules: expected a dict"),
    ("scalar_weights", 3, TypeError, r"^scalar_weights: expected a function"),
    ("module", lambda x: x, TypeError, r"^module: expected a torch.nn.Module, got a function"),
    ("module", None, TypeError, r"^module: expected a torch.nn.Module"),
    ("device_ids", ["cpu", "meta"], ValueError, r"meta"),
    ("device_ids", ["tpu"], (ValueError, RuntimeError), r"tpu"),  # type: ignore[list-item]
    ("output_device", "meta", ValueError, r"^output_device"),
    ("dim", "0", TypeError, r"^dim: expected an int"),
    ("batch_size", -1, ValueError, r"batch_size"),
    ("chunk_sizes", [1, 2, 3], ValueError, r"chunk_sizes"),
    ("weights", [1.0], ValueError, r"weights"),
    ("max_size", 0, ValueError, r"max_size"),
    ("dtype", "float16", TypeError, r"dtype"),
]


@pytest.mark.parametrize(
    ("name", "value", "error", "match"), BAD, ids=[f"{n}={v!r:.20}" for n, v, *_ in BAD]
)
def test_a_bad_option_set_later_is_refused_as_at_construction(
    name: str, value: Any, error: type[Exception], match: str
) -> None:
    given: dict[str, Any] = {"module": nn.Linear(4, 2), "device_ids": CPU2, name: value}
    with pytest.raises(error, match=match):
        dp.DataParallel(**given)
    w = dp.DataParallel(nn.Linear(4, 2), CPU2)
    before = w.__dict__.get(name, w.options.get(name))
    with pytest.raises(error, match=match):
        setattr(w, name, value)
    after = w.__dict__.get(name, w.options.get(name))
    assert after is before  # nothing kept from the refused assignment
    assert w(torch.randn(6, 4)).shape == (6, 2)  # and the wrapper still works


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum()


def test_options_set_later_take_effect() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    w = dp.DataParallel(Pair(), CPU2)
    assert_close_rel(w(x)[1], x.sum() / 2)  # "mean": the chunk-weighted mean of the chunk sums
    w.scalars = "sum"
    assert_close_rel(w(x)[1], x.sum())
    w.output_rules = {"output[1]": "stack"}
    assert w(x)[1].shape == (2,)
    w.max_size = 2
    assert w.max_size == 2 and w.options["max_size"] == 2
    w(x)
    assert w.last_call is not None and w.last_call.waves == 2
    w.max_size = None
    w.chunk_sizes = [1, 5]
    w(x)
    assert w.last_call is not None and w.last_call.chunk_sizes == [1, 5]
    w.chunk_sizes = None
    w.device_ids = ["cpu", "cpu:1", "cpu:1"]
    w(x)
    assert w.last_call is not None and w.last_call.chunk_sizes == [2, 2, 2]
    w.dtype = torch.float64
    assert w(x)[0].dtype == torch.float64


def test_a_new_module_is_checked_in_full_at_the_next_call() -> None:
    # The device check reads two sentinel tensors of the module after its first call: a new
    # module must be checked in full, not through the old module's sentinels.
    w = dp.DataParallel(nn.Linear(4, 2), CPU2)
    w(torch.randn(4, 4))
    w.module = nn.Linear(4, 3)
    assert w(torch.randn(4, 4)).shape == (4, 3)
    assert "_sentinels" in w.__dict__
    w.module = nn.Linear(4, 3).to(torch.float64)
    assert w(torch.randn(4, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("how", ["replaced", "removed", "none"])
def test_a_sentinel_place_that_lost_its_tensor_means_a_full_check(how: str) -> None:
    """The sentinels are places (a module held weakly, a table, a name): a layer replaced (the
    old one freed), a tensor removed from its table or set to ``None`` there sends the next
    call to the full check, which names the parameter left on the meta device before any
    replica runs."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ran: list[int] = []
    model[0].register_forward_pre_hook(lambda *_: ran.append(1))
    w = dp.DataParallel(model, CPU2)
    for _ in range(2):
        w(torch.randn(4, 4))
    ran.clear()
    if how == "replaced":  # the last sentinel's module is freed
        model[1] = nn.Linear(4, 2, device="meta")
    else:
        del model[1]._parameters["bias"]
        if how == "none":
            model[1].register_parameter("bias", None)
        model[1].weight = nn.Parameter(torch.empty(2, 4, device="meta"))
    with pytest.raises(RuntimeError, match=r"'1\.weight' on the meta device"):
        w(torch.randn(4, 4))
    assert not ran
