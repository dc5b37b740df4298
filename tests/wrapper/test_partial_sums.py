"""A call that passes ``num_items_in_batch``: each replica receives the whole count, the
outputs computed from it come back summed, and a loss that ignores the count keeps its mean.

``TokenLM`` follows transformers' causal LMs: with ``num_items_in_batch`` its loss is the
chunk's token sum over the whole batch's count, else the chunk's token mean. ``MeanLoss``
follows their sequence classifiers: it takes ``**kwargs`` (so Trainer passes the count) and
ignores it. Padded labels (-100) give the chunks different token counts, so averaging the
partial sums, or summing the means, is visibly wrong.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from _close import assert_close_rel
from dataparallel.wrapper._partial_sums import count_position

DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
Pair = namedtuple("Pair", ["loss", "logits"])


class TokenLM(nn.Module):
    """Token logits and a token loss, the loss reduced as transformers' causal LMs do."""

    def __init__(self, returns: str = "dict") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11)
        self.returns = returns

    def forward(
        self, ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None
    ) -> Any:
        logits = self.head(self.emb(ids))
        flat = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        if num_items_in_batch is None:
            loss = flat / (labels != -100).sum()
        else:
            loss = flat / num_items_in_batch
        aux = logits.pow(2).mean()  # a mean over the chunk: not a partial sum
        if self.returns == "scalar":
            return loss
        if self.returns == "tuple":
            return loss, logits
        if self.returns == "namedtuple":
            return Pair(loss, logits)
        return {"loss": loss, "logits": logits, "aux": aux}


class MeanLoss(nn.Module):
    """A classifier's mean loss; takes ``**kwargs`` and ignores the count, as BERT does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        logits = self.head(self.emb(ids).mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class NoCount(nn.Module):
    """A forward that does not take num_items_in_batch: the keyword is its own business."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, *, num_items_in_batch: None = None) -> torch.Tensor:
        return self.lin(x).sum() / x.shape[0]


def _batch(n: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (n, 5), generator=gen)
    labels = ids.clone()
    for i in range(n):  # right padding of varied lengths: chunks differ in token counts
        labels[i, 5 - i % 4 :] = -100
    return ids, labels, (labels != -100).sum()


def _loss(out: Any) -> torch.Tensor:
    return (
        out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out["loss"]
    )


@pytest.mark.parametrize("devices", DEVICE_LISTS)
@pytest.mark.parametrize("returns", ["dict", "scalar", "tuple", "namedtuple"])
def test_a_partial_sum_loss_comes_back_summed(devices: list[str], returns: str) -> None:
    ref_model = TokenLM(returns)
    model = copy.deepcopy(ref_model)
    ids, labels, count = _batch()
    ref = ref_model(ids, labels, num_items_in_batch=count)
    _loss(ref).backward()
    out = dp.DataParallel(model, devices)(ids, labels, num_items_in_batch=count)
    _loss(out).backward()
    assert_close_rel(_loss(out), _loss(ref), msg="loss")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert_close_rel(p.grad, q.grad, msg=name)  # type: ignore[arg-type]
    if returns == "dict":
        # other scalar outputs keep the default, a chunk-weighted mean of the chunks' means
        assert_close_rel(out["aux"], ref["aux"], msg="aux")


def test_without_the_count_the_default_mean_holds() -> None:
    ids, labels, _ = _batch(8)
    lens = (labels != -100).sum(1)
    model = TokenLM()
    out = dp.DataParallel(model, ["cpu", "cpu"])(ids, labels)
    one = [model(ids[:4], labels[:4])["loss"], model(ids[4:], labels[4:])["loss"]]
    assert_close_rel(out["loss"], (one[0] + one[1]) / 2, msg="mean of the chunks")
    assert int(lens.sum()) > 0
    out = dp.DataParallel(model, ["cpu", "cpu"])(ids, labels, num_items_in_batch=None)
    assert_close_rel(out["loss"], (one[0] + one[1]) / 2, msg="None is no count")


@pytest.mark.parametrize("chosen", ["mean", "sum", "stack"])
def test_an_explicit_scalars_leaves_the_count_exact(chosen: str) -> None:
    """scalars= says how the other scalar outputs are gathered; the loss computed from the count
    is the one-device loss whatever it says (issue 39: an explicit choice turned the count off)."""
    ids, labels, count = _batch(8)
    model = TokenLM()
    ref = model(ids, labels, num_items_in_batch=count)
    out = dp.DataParallel(model, ["cpu", "cpu"], scalars=chosen)(
        ids, labels, num_items_in_batch=count
    )
    assert_close_rel(out["loss"], ref["loss"], msg=chosen)
    wrapper = dp.DataParallel(model, ["cpu", "cpu"])
    wrapper.scalars = "mean"  # assigned on a built wrapper: the same
    assert_close_rel(wrapper(ids, labels, num_items_in_batch=count)["loss"], ref["loss"])


def test_an_output_rule_for_the_loss_decides_there() -> None:
    """A rule for the loss's own path applies to the replicas' values (each computed with the
    whole count, as one device would on that chunk); a rule for another path changes nothing."""
    ids, labels, count = _batch(8)
    model = TokenLM()
    parts = [
        model(ids[:4], labels[:4], num_items_in_batch=count)["loss"],
        model(ids[4:], labels[4:], num_items_in_batch=count)["loss"],
    ]
    wrapper = dp.DataParallel(model, ["cpu", "cpu"], output_rules={"output['loss']": "list"})
    out = wrapper(ids, labels, num_items_in_batch=count)
    assert isinstance(out["loss"], list) and type(out["loss"][1]) is torch.Tensor
    assert_close_rel(out["loss"][1], parts[1], msg="replica 1")
    other = dp.DataParallel(model, ["cpu", "cpu"], output_rules={"output['aux']": "mean"})
    got = other(ids, labels, num_items_in_batch=count)["loss"]
    assert_close_rel(got, model(ids, labels, num_items_in_batch=count)["loss"], msg="other rule")


def test_a_forward_that_does_not_take_the_keyword_raises_its_own_error() -> None:
    model = nn.Linear(3, 1)
    with pytest.raises(TypeError, match="num_items_in_batch"):
        dp.DataParallel(model, ["cpu", "cpu"])(torch.randn(4, 3), num_items_in_batch=4)
    assert count_position(TokenLM()) == 2 and count_position(nn.Linear(1, 1)) is None
    assert count_position(NoCount()) is None  # keyword-only: never by position


def test_explain_says_the_count_is_whole_and_its_outputs_summed() -> None:
    ids, labels, count = _batch()
    wrapper = dp.DataParallel(TokenLM(), ["cpu", "cpu"])
    plan = wrapper.explain(ids, labels, num_items_in_batch=count)
    assert plan.notes and "receives the whole count" in plan.notes[0]
    assert "note: num_items_in_batch=" in str(plan)
    assert "(args[2])" in wrapper.explain(ids, labels, 13).notes[0]  # by position
    notes = wrapper.explain(ids, labels).notes  # no count: the loss terms' rule alone
    assert len(notes) == 1 and notes[0].startswith("scalar outputs: ")
    assert not dp.DataParallel(TokenLM(), ["cpu"]).explain(ids, labels, 13).notes  # one chunk


def test_the_default_still_reads_mean_and_survives_copies() -> None:
    wrapper = dp.DataParallel(nn.Linear(2, 2), ["cpu", "cpu"])
    assert wrapper.scalars == "mean" and repr(wrapper.scalars) == "'mean'"
    ids, labels, count = _batch()
    ref = TokenLM()(ids, labels, num_items_in_batch=count)["loss"]
    lm = dp.DataParallel(TokenLM(), ["cpu", "cpu"])
    for again in (copy.deepcopy(lm), pickle.loads(pickle.dumps(lm))):
        assert_close_rel(again(ids, labels, num_items_in_batch=count)["loss"], ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dp.data_parallel(
            TokenLM(),
            _batch()[:2],
            ["cpu", "cpu"],
            module_kwargs={"num_items_in_batch": _batch()[2]},
        )
    ids, labels, count = _batch()
    assert_close_rel(out["loss"], TokenLM()(ids, labels, num_items_in_batch=count)["loss"])


@pytest.mark.parametrize("devices", DEVICE_LISTS)
def test_a_loss_that_ignores_the_count_keeps_its_mean(devices: list[str]) -> None:
    ref_model = MeanLoss()
    model = copy.deepcopy(ref_model)
    ids, tokens, count = _batch()
    labels = tokens[:, 0] % 3  # one class per sample, as a sequence classifier takes
    ref = ref_model(ids, labels, num_items_in_batch=count)
    ref["loss"].backward()
    out = dp.DataParallel(model, devices)(ids, labels, num_items_in_batch=count)
    out["loss"].backward()
    assert_close_rel(out["loss"], ref["loss"], msg="loss")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert_close_rel(p.grad, q.grad, msg=name)  # type: ignore[arg-type]


def test_with_scalar_weights_and_waves() -> None:
    """The parts are summed over every chunk of every wave under max_size; scalar_weights
    weighs only the outputs that do not depend on the count."""
    ids, labels, count = _batch(9)
    ref = TokenLM()(ids, labels, num_items_in_batch=count)["loss"]
    tokens = lambda a, kw: (a[1] != -100).sum()  # noqa: E731
    for opts in (
        {"scalar_weights": tokens},
        {"max_size": 2},
        {"max_size": 2, "scalar_weights": tokens},
    ):
        out = dp.DataParallel(TokenLM(), ["cpu", "cpu:1"], **opts)(
            ids, labels, num_items_in_batch=count
        )
        assert_close_rel(out["loss"], ref, msg=str(opts))
    one = dp.DataParallel(TokenLM(), ["cpu"])(ids, labels, num_items_in_batch=int(count))
    assert_close_rel(one["loss"], ref, msg="one device")


def test_the_count_a_replica_receives() -> None:
    """Each replica receives the whole count, of the type given; what the caller gets back
    (gathered or not) is unmarked."""
    seen: list[Any] = []

    class Spy(TokenLM):
        def forward(
            self, ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None
        ) -> Any:
            seen.append(num_items_in_batch)
            out = super().forward(ids, labels, num_items_in_batch)
            out["n"] = num_items_in_batch
            return out

    ids, labels, _ = _batch(6)
    kwargs = {"num_items_in_batch": 12}
    out = dp.DataParallel(Spy(), ["cpu", "cpu", "cpu"])(ids, labels, **kwargs)
    assert seen == [12, 12, 12] and all(isinstance(n, int) for n in seen)
    assert kwargs == {"num_items_in_batch": 12} and type(kwargs["num_items_in_batch"]) is int
    assert out["n"] == 12 and type(out["n"]) is int and type(out["loss"]) is torch.Tensor
    seen.clear()
    parts = dp.DataParallel(Spy(), ["cpu", "cpu"], gather=False)(
        ids, labels, num_items_in_batch=torch.tensor(12)
    )
    assert [int(n) for n in seen] == [12, 12]
    for part in parts:  # per-device outputs: plain values, each computed with the whole count
        assert type(part["loss"]) is torch.Tensor and type(part["n"]) is torch.Tensor


class Escapes(TokenLM):
    """Turns the count into a plain number before dividing: nothing can follow it."""

    def __init__(self, how: str) -> None:
        super().__init__("dict")
        self.how = how
        self.hand = False

    def forward(
        self, ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None
    ) -> Any:
        n = num_items_in_batch
        plain = n.item() if self.how == "item" else float(n)
        logits = self.head(self.emb(ids))
        if self.hand:  # a loss no torch loss function built: nothing tells what it is
            picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])
            flat = -(picked[..., 0] * (labels != -100)).sum()
        else:
            flat = nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
            )
        return {"loss": flat / plain, "logits": logits}


@pytest.mark.parametrize("how", ["item", "float"])
def test_a_count_turned_into_a_plain_number_divides_a_summed_cross_entropy(how: str) -> None:
    """cross_entropy's sum over the whole count, a Python number equal on every chunk: a
    constant multiple of a sum, summed (issue 59; before, refused)."""
    ids, labels, count = _batch()
    given = count if how == "item" else int(count)
    model = Escapes(how)
    out = dp.DataParallel(model, ["cpu", "cpu"])(ids, labels, num_items_in_batch=given)
    assert_close_rel(out["loss"], model(ids, labels, num_items_in_batch=given)["loss"])


@pytest.mark.parametrize("how", ["item", "float"])
def test_a_count_turned_into_a_plain_number_is_refused_naming_the_rule(how: str) -> None:
    ids, labels, count = _batch()
    given = count if how == "item" else int(count)
    model = Escapes(how)
    model.hand = True
    with pytest.raises(ValueError, match="num_items_in_batch into a plain number") as err:
        dp.DataParallel(model, ["cpu", "cpu"])(ids, labels, num_items_in_batch=given)
    assert """output_rules={"output['loss']": 'sum'}""" in str(err.value)
    rules = {"output['loss']": "sum"}
    out = dp.DataParallel(model, ["cpu", "cpu"], output_rules=rules)(
        ids, labels, num_items_in_batch=given
    )
    assert_close_rel(out["loss"], model(ids, labels, num_items_in_batch=given)["loss"])


def test_equal_parts_are_still_parts() -> None:
    """Two chunks of equal data give equal parts of the loss, in evaluation without a
    gradient: each is still a part (computed from the count and the chunk), summed; a value
    computed from the count alone (a tensor of its size) comes back once."""

    class Both(TokenLM):
        def forward(
            self, ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None
        ) -> Any:
            out = super().forward(ids, labels, num_items_in_batch)
            out["ones"] = ids.new_ones(num_items_in_batch)
            return out

    ids, labels, count = _batch(1)
    ids, labels = ids.repeat(4, 1), labels.repeat(4, 1)  # four equal rows, two equal chunks
    model = Both()
    with torch.no_grad():
        ref = model(ids, labels, num_items_in_batch=4 * count)
        for n in (4 * int(count), 4 * count):
            out = dp.DataParallel(model, ["cpu", "cpu"])(ids, labels, num_items_in_batch=n)
            assert_close_rel(out["loss"], ref["loss"], msg="equal parts")
            assert torch.equal(out["ones"], ref["ones"]) and type(out["ones"]) is torch.Tensor


def test_a_forward_replaced_between_warm_calls_is_asked_again_for_the_count() -> None:
    """The warm step keeps whether a call passes the count per forward function: a forward
    replaced on the instance, which takes the count where the old one took a plain factor, is
    read again, and the same call's second argument becomes the whole count (its sum over the
    chunks comes back summed, as one device's)."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum() * scale

    def counted(self: Scaled, x: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        return self.lin(x).sum() / num_items_in_batch

    model = Scaled()
    x, n = torch.randn(8, 3), torch.tensor(8.0)
    w = dp.DataParallel(model, ["cpu", "cpu"])
    for _ in range(3):  # warm: the kept plan's step serves these calls
        w(x, n)
    assert any(template.memo.get("warm") is not None for _, template in w._plans.plans)
    model.forward = counted.__get__(model)  # the second positional is now the count
    assert_close_rel(w(x, n), counted(model, x, n), msg="output")
