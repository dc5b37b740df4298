"""``dataparallel.gather._output_rules``: ``output_rules=`` and the cases shapes alone cannot
settle.

End to end, the gathered output with a rule must be what the module returns on one device
(the oracle); the checks of the rules themselves name the bad key or value.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.gather._output_rules import check_output_rules, rnn_state_shapes, warn_unmatched

CPU2 = ["cpu", "cpu"]


class CountAndConstant(nn.Module):
    """Returns the batch plus one, a count of its samples and a constant equal to 2."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"y": x + 1, "n": int(x.shape[0]), "two": 2}


def _run(rules: dict[str, Any] | None, x: torch.Tensor) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dp.DataParallel(CountAndConstant(), CPU2, output_rules=rules)(x)
    return out, [str(w.message) for w in caught]


def test_rules_give_the_one_device_output_on_an_even_split() -> None:
    x = torch.randn(4, 3)
    expected = CountAndConstant()(x)
    out, messages = _run({"output['n']": "sum", "output['two']": "same"}, x)
    torch.testing.assert_close(out["y"], expected["y"])
    assert (out["n"], out["two"]) == (expected["n"], expected["two"]) == (4, 2)
    assert messages == []  # the rules settle what the warning would ask


def test_without_rules_an_even_count_is_summed_with_a_warning() -> None:
    out, messages = _run(None, torch.randn(4, 3))
    assert out["n"] == 4  # a count: what one device returns
    assert out["two"] == 4  # a constant equal to the chunk size looks the same: summed too
    assert any(m.startswith("output['two']: every replica returned 2") for m in messages)
    assert any("""output_rules={"output['two']": 'same'}""" in m for m in messages)


def test_an_uneven_split_needs_no_rule() -> None:
    x = torch.randn(5, 3)
    out, messages = _run(None, x)
    assert (out["n"], out["two"]) == (5, 2)
    assert messages == []


def test_a_rule_for_no_output_is_reported_as_a_likely_typo() -> None:
    _, messages = _run({"output['m']": "sum"}, torch.randn(5, 3))
    assert any("""["output['m']"] matched no output""" in m for m in messages)
    assert any("output['two']" in m for m in messages)  # the outputs it has are listed


def test_warn_unmatched_is_silent_when_every_path_matched() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unmatched({"output[0]": 0}, ["output[0]", "output[1]"])


def test_check_output_rules_normalises_dims_and_keeps_names() -> None:
    assert check_output_rules(None) is None
    rules = check_output_rules({"output[0]": np.int64(1), "output[1]": "mean"})
    assert rules == {"output[0]": 1, "output[1]": "mean"}
    assert type(rules["output[0]"]) is int  # type: ignore[index]


@pytest.mark.parametrize(
    ("rules", "error", "names"),
    [
        ([("output", 0)], TypeError, "got list"),
        ({"logits": 0}, ValueError, "'logits'"),
        ({"output[0]": "max"}, ValueError, "'max'"),
        ({"output[0]": True}, ValueError, "True"),
        ({"output[0]": 1.0}, ValueError, "1.0"),
    ],
)
def test_bad_rules_name_what_is_wrong(rules: Any, error: type[Exception], names: str) -> None:
    with pytest.raises(error, match="expected") as info:
        check_output_rules(rules)
    assert names in str(info.value)


def test_rnn_state_shapes_cover_every_rnn_layer() -> None:
    model = nn.ModuleDict(
        {
            "lstm": nn.LSTM(4, 8, num_layers=2, proj_size=3),
            "gru": nn.GRU(4, 6, bidirectional=True),
            "fc": nn.Linear(4, 4),
        }
    )
    assert rnn_state_shapes(model) == {(2, 8), (2, 3), (2, 6)}
    assert rnn_state_shapes(nn.Linear(4, 4)) == frozenset()
    assert rnn_state_shapes(None) == frozenset()


def test_an_rnn_state_is_gathered_along_its_batch_dim() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 5, num_layers=2)  # h_n: (2, batch, 5); a chunk of 2 looks like a batch
    x = torch.randn(7, 4, 3)  # (time, batch, features): the batch is on dim 1
    expected, (h, c) = lstm(x)
    out, (h_dp, c_dp) = dp.DataParallel(lstm, CPU2, dim=1)(x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(h_dp, h)
    torch.testing.assert_close(c_dp, c)


@pytest.mark.parametrize("devices", [["cpu"], CPU2])
def test_rules_apply_the_same_on_one_device_as_on_two(devices: list[str]) -> None:
    # One rule set whatever the device count: "list" is one value per replica, so one device
    # gives a list of one (as scalars="stack" gives a vector of one); a count stays a count.
    x = torch.randn(4, 3)
    rules = {"output['n']": "sum", "output['two']": "list"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = dp.DataParallel(CountAndConstant(), devices, output_rules=rules)(x)
    torch.testing.assert_close(out["y"], x + 1)
    assert out["n"] == 4
    assert out["two"] == [2] * len(devices)


class TimeMajorHead(nn.Module):
    """CRNN's output (meijieru/crnn.pytorch): per-frame class scores, time-major ``(T, B, C)``."""

    def __init__(self, frames: int) -> None:
        super().__init__()
        self.frames = frames
        self.lin = nn.Linear(3, frames * 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(x.shape[0], self.frames, 6).transpose(0, 1)


def test_a_time_major_output_whose_length_is_the_chunk_size_is_said() -> None:
    """(T, B, C) with T == 5 on chunks of 5: both readings fit; torch's (dim 0) is taken, with
    a warning naming the path and the fix; check= names the difference and the same fix."""
    torch.manual_seed(0)
    head, x = TimeMajorHead(5), torch.randn(10, 3)
    want = head(x)  # (5, 10, 6)
    fix = r"output_rules=\{'output': 1\}"
    with pytest.warns(
        UserWarning, match=rf"output: every replica returned shape \(5, 5, 6\).*{fix}"
    ):
        assert dp.DataParallel(head, CPU2)(x).shape == (10, 5, 6)
    torch.testing.assert_close(dp.DataParallel(head, CPU2, output_rules={"output": 1})(x), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silenced by the rule, and other T fit one reading
        dp.DataParallel(head, CPU2, output_rules={"output": 0})(x)
        other = TimeMajorHead(4)
        torch.testing.assert_close(dp.DataParallel(other, CPU2)(x), other(x))
    checked = dp.DataParallel(head, CPU2, check=True)
    with pytest.warns(dp.OneDeviceDifference, match=rf"output: shape \(10, 5, 6\).*{fix}"):
        checked(x)
