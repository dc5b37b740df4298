"""What a user reads: the broadcast warning, the ``explain`` table and the device-list errors.

Each test reads the text itself (the warning a call raises, ``str(plan)``, the error message)
and checks that it tells the user the truth and the fix; the "each device receives" part of
the table is checked against what scatter really hands each device.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel.app.scenarios import SCENARIOS
from dataparallel.plan import plan
from dataparallel.scatter import take

CPU2 = ["cpu", "cpu"]


class Three(nn.Module):
    """``model(images, x2, labels)``: the issue's call, with a shared batch-1 input."""

    def forward(self, images: torch.Tensor, x2: torch.Tensor, labels: torch.Tensor) -> Any:
        return images.flatten(1).sum(1) + x2.sum() + labels


def _warning_of(model: nn.Module, *args: Any) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(*args)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    return messages[0]


# ------------------------------------------------------------------------- the broadcast warning


def test_warning_leads_with_shared_for_the_input_it_is_about() -> None:
    images, x2, labels = torch.randn(10, 3, 4, 4), torch.randn(1, 5), torch.randn(10)
    model = dp.DataParallel(Three(), CPU2)
    text = _warning_of(model, images, x2, labels)
    assert text.startswith(
        "args[1] has size 1 along dim 0, not the batch size 10 (voted by args[0], args[2]), "
        "so it is broadcast whole to every device. To fix: wrap args[1] in dp.Shared(...) if "
        "it is meant to be shared"
    ), text
    # then the other reading: the input is batched and the batch size is wrong
    fixes = text.split("To fix: ", 1)[1]
    assert fixes.index("dp.Shared(...) if it is meant") < fixes.index("if it is batched")
    assert "wrap args[0] and args[2] in dp.Shared(...) if they are not batched" in fixes
    assert "pass the right batch_size=N" in fixes
    assert "wrap args[1] in dp.Split(...)" in fixes


def test_the_first_fix_silences_the_warning_and_keeps_the_output() -> None:
    images, x2, labels = torch.randn(10, 3, 4, 4), torch.randn(1, 5), torch.randn(10)
    reference = Three()(images, x2, labels)
    model = dp.DataParallel(Three(), CPU2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        out = model(images, dp.Shared(x2), labels)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_warning_in_the_other_order_names_the_voter_to_share() -> None:
    # (x2, x1): B = 1 by the earliest vote; the batched x1 is broadcast, and the fix for the
    # user who meant x1 as the batch is dp.Shared on x2 (args[0]).
    x2, x1 = torch.zeros(1, 10, 20), torch.zeros(10, 3, 4, 4)
    (text,) = dp.plan((x2, x1), None, CPU2).warnings
    assert text.startswith("args[1] has size 10 along dim 0, not the batch size 1 (voted by")
    assert "To fix: wrap args[1] in dp.Shared(...) if it is meant to be shared" in text
    assert "wrap args[0] in dp.Shared(...) if it is not batched" in text


def test_warning_with_several_inputs_names_them_all() -> None:
    x, t1, t2 = torch.zeros(4, 3), torch.zeros(2, 3), torch.zeros(3, 3)
    (text,) = dp.plan((x, t1, t2), None, CPU2).warnings
    assert "args[1] has size 2 along dim 0; args[2] has size 3 along dim 0" in text
    assert "so they are broadcast whole" in text
    assert "To fix: wrap args[1] and args[2] in dp.Shared(...) if they are meant to be shared" in (
        text
    )
    assert "wrap the batched one of args[1] and args[2] in dp.Split(...)" in text


def test_warning_when_batch_size_is_set_offers_no_voter() -> None:
    x, t = torch.zeros(4, 3), torch.zeros(3, 3)
    (text,) = dp.plan((x, t), None, CPU2, batch_size=4).warnings
    assert "(set by batch_size=)" in text
    assert "To fix: wrap args[1] in dp.Shared(...) if it is meant to be shared" in text
    assert "voted" not in text and "if it is not batched" not in text


# ------------------------------------------------------------------------------ explain table


def _receive_table(text: str) -> dict[str, tuple[str, str]]:
    """``{path: (moved to, receives)}`` read back from the printed table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("each device receives"))
    header = lines[start + 1]
    assert header.split() == ["path", "moved", "to", "receives"], header
    to_col, rec_col = header.index("moved to"), header.index("receives")
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("  "):
            break
        rows[line[2:to_col].strip()] = (line[to_col:rec_col].strip(), line[rec_col:].strip())
    return rows


def _joined(parts: list[str]) -> str:
    return parts[0] if len(set(parts)) == 1 else "/".join(parts)


def _real_split_text(chunks: list[Any]) -> tuple[str, str]:
    """What the table should say for a split tensor, built from the real chunks."""
    kind = "Tensor" if isinstance(chunks[0], torch.Tensor) else "ndarray"
    shapes = [list(c.shape) for c in chunks]
    dims = [_joined([str(s[i]) for s in shapes]) for i in range(len(shapes[0]))]
    dtypes = {str(c.dtype).removeprefix("torch.") for c in chunks}
    (dtype,) = dtypes
    if kind == "ndarray":
        return "not moved (ndarray)", f"ndarray[{', '.join(dims)}] {dtype}"
    return _joined([str(c.device) for c in chunks]), f"Tensor[{', '.join(dims)}] {dtype}"


def _check_against_scatter(p: dp.Plan) -> int:
    """Compare every split and broadcast tensor row with what ``take`` gives each device."""
    rows = _receive_table(str(p))
    chunks = [take(p, start, length, device) for wave in p.slices for device, start, length in wave]
    checked = 0
    for entry in p.entries:
        got = [eval(entry.path, {}, {"args": a, "kwargs": k}) for a, k in chunks]
        assert rows[entry.path] == (entry.to, entry.receives)
        if entry.rule == "split":
            assert rows[entry.path] == _real_split_text(got), entry.path
            checked += 1
        elif entry.rule == "broadcast" and isinstance(got[0], torch.Tensor):
            to, receives = _real_split_text(got)
            shown_to, shown = rows[entry.path]
            assert (shown_to, shown.removesuffix(" (dp.Shared: not cast)")) == (
                to,
                "the whole " + receives,
            ), entry.path
            checked += 1
    return checked


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_explain_shows_what_each_device_receives_for_every_scenario(name: str) -> None:
    s = SCENARIOS[name]()
    p = plan(s.inputs, s.kwargs, s.devices, **s.opts)
    assert _check_against_scatter(p) >= 1 or name == "S1"


def test_explain_shows_the_cast_of_s5_chunks() -> None:
    s = SCENARIOS["S5-chunks"]()
    text = str(plan(s.inputs, s.kwargs, s.devices, **s.opts))
    assert "Tensor[16, 8] float32" in text  # what was passed
    assert _receive_table(text)["args[0]"] == ("cpu", "Tensor[2/6/4/4, 8] float16")


def test_explain_per_sample_items_each_chunk_gets() -> None:
    s = SCENARIOS["S1"]()
    p = plan(s.inputs, s.kwargs, s.devices)
    assert _receive_table(str(p))["args[0]"] == (
        "not moved (no tensor)",
        "list[8] of ndarray: items 0-7/8-15",
    )
    # the items each chunk really gets
    chunks = [take(p, start, n, d)[0][0] for d, start, n in p.slices[0]]
    assert [int(c[0][0, 0]) for c in chunks] == [0, 8]
    assert [len(c) for c in chunks] == [8, 8]


def test_explain_mixed_call_cast_shared_and_objects() -> None:
    images = [torch.randn(3, 5 + i, 5) for i in range(4)]
    targets = [
        {"boxes": torch.zeros(i + 1, 4), "labels": torch.zeros(i + 1).long()} for i in range(4)
    ]
    table = dp.Shared(torch.zeros(7, 2))
    arr = np.zeros((4, 2))
    p = plan(
        (images, targets, table, arr, 3),
        {"names": ["a", "b", "c", "d"]},
        ["cpu", "cpu", "cpu"],
        dtype=torch.float16,
    )
    rows = _receive_table(str(p))
    assert rows["args[0]"] == (
        "cpu",
        "list[2/1/1] of Tensor: items 0-1/2/3, float tensors cast to float16",
    )
    assert rows["args[1]"][1].endswith("items 0-1/2/3, float tensors cast to float16")
    assert rows["args[2]"] == ("cpu", "the whole Tensor[7, 2] float32 (dp.Shared: not cast)")
    assert rows["args[3]"] == ("not moved (ndarray)", "ndarray[2/1/1, 2] float64")
    assert rows["args[4]"] == ("not moved (no tensor)", "the same object")
    assert rows["kwargs['names']"] == ("not moved (no tensor)", "list[2/1/1] of str: items 0-1/2/3")
    assert _check_against_scatter(p) == 2  # the ndarray split and the shared tensor
    # and the cast is real
    first = take(p, 0, 2, torch.device("cpu"))[0]
    assert first[0][0].dtype == torch.float16 and first[1][0]["labels"].dtype == torch.long
    assert first[2].dtype == torch.float32


def test_explain_with_no_inputs_says_there_is_nothing_to_split() -> None:
    model = dp.DataParallel(nn.Linear(2, 2), CPU2)
    text = str(model.explain())
    assert text.startswith("nothing to split: the call passes no input")
    assert "runs once, on cpu" in text
    assert "batch size" not in text and "no leaves" not in text
    assert str(dp.plan(((), {}), None, CPU2)).startswith("nothing to split")


# ------------------------------------------------------------------------------ device lists


@pytest.mark.parametrize("text", ["cpu,cpu", "cpu, cpu", "0,1"])
def test_a_comma_string_of_devices_asks_for_a_list(text: str) -> None:
    with pytest.raises(ValueError) as info:
        dp.DataParallel(nn.Linear(2, 2), device_ids=text)
    message = str(info.value)
    assert message.startswith(f"device_ids: expected a list of devices, got the string {text!r}")
    assert "['cpu', 'cpu']" in message or "[0, 1]" in message
    assert "use 'cpu'" not in message


def test_the_suggested_device_list_works() -> None:
    with pytest.raises(ValueError, match=r"pass device_ids=\['cpu', 'cpu'\]"):
        dp.plan((torch.zeros(4, 2),), None, "cpu,cpu")
    assert dp.plan((torch.zeros(4, 2),), None, ["cpu", "cpu"]).chunk_sizes == [2, 2]
