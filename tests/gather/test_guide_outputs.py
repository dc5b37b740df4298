"""The two gather surprises of issue 42, and the guide's ``output_rules`` paths.

- A per-sample output squeezed to 0-dim on 1-sample chunks (``nn.Linear(h, 1)(x).squeeze()`` on
  a last batch of 2 on two devices) cannot be told from a per-chunk loss: it is averaged like
  one, with a warning (once per wrapper) naming ``output_rules`` and the ``squeeze()`` pattern.
- A model-output class's field (transformers' ``SequenceClassifierOutput``) is named one way in
  every message, ``output['logits']``, and ``output_rules`` accepts ``output.logits`` as well.

Each case runs against the same module on one device (the oracle), on the three device lists.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel

transformers_outputs = pytest.importorskip("transformers.modeling_outputs")
SequenceClassifierOutput = transformers_outputs.SequenceClassifierOutput

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


class Squeezed(nn.Module):
    """The binary classifier's head: one logit per sample, squeezed to shape ``(batch,)``,
    which is 0-dim on a 1-sample chunk."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).squeeze()


class Classifier(nn.Module):
    """A transformers-style classifier: a ``SequenceClassifierOutput`` with a mean loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class Targets(Classifier):
    """The classifier with its targets passed as ``y``: no labels to read the loss from."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:  # type: ignore[override]
        return super().forward(x, y)


def _calls(run: Callable[[], Any], times: int = 1) -> tuple[list[Any], list[str]]:
    """``run()`` called ``times`` times, with every warning recorded (Python's filter off)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [run() for _ in range(times)]
    return results, [str(w.message) for w in caught]


def _squeeze_warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if "1-sample chunk" in m]


# ----------------------------------------------------------- item 1: squeeze() on 1 sample


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_squeezed_output_of_one_sample_chunks_warns_once_per_wrapper(devices: list[str]) -> None:
    n = len(devices)
    x = torch.randn(n, 4)
    expected = Squeezed()(x)
    assert expected.shape == (n,)  # one device: one value per sample
    model = dp.DataParallel(Squeezed(), devices)
    (out, again), messages = _calls(lambda: model(x), times=2)
    # Read as a per-chunk scalar: the chunk-weighted mean (unchanged behaviour) ...
    assert out.shape == ()
    assert_close_rel(out, expected.mean())
    assert_close_rel(again, out)
    # ... said once for this wrapper, naming output_rules and the squeeze() pattern.
    found = _squeeze_warnings(messages)
    assert len(found) == 1, messages
    assert "squeeze()" in found[0] and "output_rules={'output': 'stack'}" in found[0]
    assert f"chunk sizes {[1] * n}" in found[0]
    # Another wrapper says it again: once per wrapper, not once per process.
    _, messages = _calls(lambda: dp.DataParallel(Squeezed(), devices)(x))
    assert len(_squeeze_warnings(messages)) == 1


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_stack_rule_gives_the_one_device_vector_and_gradients(devices: list[str]) -> None:
    n = len(devices)
    x = torch.randn(n, 4)
    oracle = Squeezed()
    expected = oracle(x)
    expected.pow(2).sum().backward()
    module = Squeezed()
    model = dp.DataParallel(module, devices, output_rules={"output": "stack"})
    (out,), messages = _calls(lambda: model(x))
    assert _squeeze_warnings(messages) == []
    assert_close_rel(out, expected)
    out.pow(2).sum().backward()
    for p, q in zip(module.parameters(), oracle.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close_rel(p.grad, q.grad)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_one_sample_losses_warn_under_their_path_and_a_mean_rule_silences(
    devices: list[str],
) -> None:
    n = len(devices)
    x, labels = torch.randn(n, 4), torch.arange(n) % 3
    expected = Classifier()(x, labels)
    # A loss that cross_entropy built says what it is (a mean over the chunk's targets),
    # whatever the targets are called (issue 59): no squeezed output to warn of
    for cls in (Classifier, Targets):
        (out,), messages = _calls(lambda c=cls: dp.DataParallel(c(), devices)(x, labels))
        assert_close_rel(out.loss, expected.loss)
        assert _squeeze_warnings(messages) == []
    model = dp.DataParallel(Targets(), devices, output_rules={"output['loss']": "mean"})
    (out,), messages = _calls(lambda: model(x, labels))
    assert messages == []
    assert_close_rel(out.loss, expected.loss)
    assert_close_rel(out.logits, expected.logits)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_larger_chunks_and_received_values_do_not_warn(devices: list[str]) -> None:
    n = len(devices)
    x, labels = torch.randn(2 * n, 4), torch.arange(2 * n) % 3
    (out,), messages = _calls(lambda: dp.DataParallel(Classifier(), devices)(x, labels))
    assert messages == []
    assert_close_rel(out.loss, Classifier()(x, labels).loss)

    class Step(nn.Module):  # returns a buffer as it is: each replica received it
        step: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("step", torch.tensor(7))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.step

    (out,), messages = _calls(lambda: dp.DataParallel(Step(), devices)(torch.randn(n, 4)))
    assert messages == [] and int(out) == 7


def test_gather_alone_warns_for_one_sample_chunks_and_not_under_stack() -> None:
    parts = [torch.tensor(1.0), torch.tensor(3.0)]
    (out,), messages = _calls(lambda: dp.gather(parts, "cpu", chunk_sizes=[1, 1]))
    assert float(out) == 2.0 and len(_squeeze_warnings(messages)) == 1
    (out,), messages = _calls(lambda: dp.gather(parts, "cpu", chunk_sizes=[1, 1], scalars="stack"))
    assert out.tolist() == [1.0, 3.0] and messages == []
    (out,), messages = _calls(lambda: dp.gather(parts, "cpu", chunk_sizes=[2, 1]))
    assert messages == []


# ------------------------------------------------ item 2: model-output fields, one spelling


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
@pytest.mark.parametrize("path", ["output.logits", "output['logits']"])
def test_model_output_fields_match_in_either_spelling(devices: list[str], path: str) -> None:
    n = len(devices)
    x, labels = torch.randn(2 * n + 1, 4), torch.arange(2 * n + 1) % 3
    expected = Classifier()(x, labels)
    model = dp.DataParallel(Classifier(), devices, output_rules={path: "list"})
    (out,), messages = _calls(lambda: model(x, labels))
    assert messages == []  # no "matched no output"
    assert type(out) is SequenceClassifierOutput
    assert isinstance(out.logits, list) and len(out.logits) == n  # the rule applied
    assert_close_rel(torch.cat(out.logits), expected.logits)
    assert_close_rel(out.loss, expected.loss)


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=str)
def test_messages_spell_model_output_fields_one_way(devices: list[str]) -> None:
    n = len(devices)
    x, labels = torch.randn(2 * n, 4), torch.arange(2 * n) % 3
    model = dp.DataParallel(Classifier(), devices, output_rules={"output.logit": "list"})
    _, messages = _calls(lambda: model(x, labels))
    (message,) = messages
    assert "['output.logit'] matched no output" in message
    # Set fields and None fields alike, as keys: the spelling rules accept and explain prints.
    for field in ("loss", "logits", "hidden_states", "attentions"):
        assert f"output['{field}']" in message
        assert f"output.{field}" not in message
    # The batch rules name a model output passed as an input by key too.
    plan = dp.DataParallel(nn.Identity(), devices).explain(SequenceClassifierOutput(logits=x))
    assert "args[0]['logits']" in str(plan)


# ------------------------------------------------------- the guide's output_rules examples

# The output each of the guide's example paths is written for, made by a small module: a
# new example in the guide needs its output here (the test says which).
_GUIDE_OUTPUTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "output['k']": lambda x: {"y": x, "k": 2},
    "output['n']": lambda x: {"y": x + 1, "n": int(x.shape[0]), "two": 2},
    "output[1][0]": lambda x: nn.LSTM(4, 3, batch_first=True)(x.unsqueeze(1)),
    "output.logits": lambda x: SequenceClassifierOutput(logits=x * 2),
    "output['logits']": lambda x: SequenceClassifierOutput(logits=x * 2),
    "output['loss']": lambda x: {"loss": x.square().mean(), "y": x},
    "output['total']": lambda x: {"y": x, "total": 5},
}


def _guide_paths() -> set[str]:
    text = GUIDE.read_text(encoding="utf-8")
    return set(re.findall(r"""["'](output(?:\[[^\]]*\]|\.[A-Za-z_]\w*)+)["']""", text))


def test_the_guide_gives_output_rules_paths_in_both_spellings() -> None:
    paths = _guide_paths()
    unknown = paths - set(_GUIDE_OUTPUTS)
    assert not unknown, f"add the outputs these guide examples are written for: {unknown}"
    assert {"output.logits", "output['logits']", "output[1][0]"} <= paths


@pytest.mark.parametrize("path", sorted(_GUIDE_OUTPUTS))
def test_each_guide_path_matches_an_output(path: str) -> None:
    assert path in _guide_paths(), f"{path} is no longer an example in the guide"
    make = _GUIDE_OUTPUTS[path]

    class Returns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.made = make  # (a plain attribute: the same function on every replica)

        def forward(self, x: torch.Tensor) -> Any:
            torch.manual_seed(0)  # the LSTM's weights: the same on every replica
            return self.made(x)

    x = torch.randn(5, 4)
    model = dp.DataParallel(Returns(), ["cpu", "cpu"], output_rules={path: "list"})
    (out,), messages = _calls(lambda: model(x))
    assert not [m for m in messages if "matched no output" in m], messages
    value = out
    for key in re.findall(r"\[(\d+|'[^']*')\]|\.(\w+)", path[len("output") :]):
        index, name = key
        value = getattr(value, name) if name else value[ast.literal_eval(index)]
    assert isinstance(value, list) and len(value) == 2  # the rule applied at that path
