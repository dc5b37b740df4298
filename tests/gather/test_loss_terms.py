"""A loss gathered from how forward built it (issue 59): each case against one device.

Each module computes its loss in forward as a real program does (CTC, segmentation with 255,
BERT pre-training's two heads, a per-sample token mean, boxes over a count, a regulariser
beside a count-scaled sum); its chunks hold different amounts of what each mean divides by, so
a chunk-size mean (or a rule about an argument named ``labels``) is off. The wrapped loss and
gradients must be one device's. Terms that cannot be re-formed are told at the call.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp
from _close import assert_close_rel

DEVICES = [["cpu", "cpu"], ["cpu", "cpu", "cpu"]]


def _same(model: nn.Module, devices: list[str], *args: Any, **kwargs: Any) -> None:
    """The wrapped loss and every gradient equal one device's (relative 1e-5)."""
    par = copy.deepcopy(model)
    want = model(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to tell: every term re-formed
        got = dp.DataParallel(par, devices)(*args, **kwargs)
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    assert_close_rel(got, want, msg="loss")
    want.backward()
    got.backward()
    for (name, p), q in zip(model.named_parameters(), par.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert_close_rel(q.grad, p.grad, msg=f"{name}.grad")


class CTC(nn.Module):
    """torch's CTC over targets of different lengths: 'mean' is a mean over samples of each
    loss over its target length, 'sum' a sum."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 6)
        self.ctc = nn.CTCLoss(reduction=reduction, zero_infinity=True)

    def forward(self, feats: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
        log_probs = self.proj(feats).log_softmax(-1).transpose(0, 1)  # (T, N, C)
        mask = labels >= 0  # -100 pads the targets, as in Wav2Vec2ForCTC
        lengths = mask.sum(-1)
        flat = labels.masked_select(mask)
        inputs = torch.full((feats.shape[0],), feats.shape[1], dtype=torch.long)
        return self.ctc(log_probs, flat, inputs, lengths), log_probs


def _ctc_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(n, 12, 4, generator=gen)
    labels = torch.randint(1, 6, (n, 5), generator=gen)
    for i in range(n):
        labels[i, 1 + (3 * i) % 5 :] = -100  # lengths 1..5, spread unevenly over the chunks
    return feats, labels


@pytest.mark.parametrize("devices", DEVICES, ids=len)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ctc_mean_and_sum(reduction: str, devices: list[str]) -> None:
    _same(CTC(reduction), devices, *_ctc_batch(7))


class Segmenter(nn.Module):
    """Per-pixel cross-entropy that ignores 255 (the void label of VOC and Cityscapes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.conv(pixel_values)
        loss = nn.CrossEntropyLoss(ignore_index=255)(logits, labels)
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_segmentation_ignoring_255(devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(2)
    images = torch.randn(6, 3, 5, 5, generator=gen)
    labels = torch.randint(0, 5, (6, 5, 5), generator=gen)
    labels[:2, 1:] = 255  # the first images are mostly void
    model = Segmenter()
    par = copy.deepcopy(model)
    want = model(images, labels)["loss"]
    got = dp.DataParallel(par, devices)(images, labels)["loss"]
    assert_close_rel(got, want)


class PreTraining(nn.Module):
    """BERT pre-training's loss: the masked-LM token mean plus the next-sentence sample mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.lm = nn.Linear(8, 11)
        self.nsp = nn.Linear(8, 2)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, next_sentence_label: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.emb(input_ids)
        scores = self.lm(hidden)
        mlm = F.cross_entropy(scores.view(-1, 11), labels.view(-1))
        nsp = F.cross_entropy(self.nsp(hidden[:, 0]), next_sentence_label)
        return mlm + nsp, scores


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_masked_lm_plus_next_sentence(devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (6, 7), generator=gen)
    labels = torch.randint(0, 11, (6, 7), generator=gen)
    labels[torch.rand(6, 7, generator=gen) < 0.6] = -100
    labels[:2] = -100  # a first chunk with no masked token: its NSP term still counts
    labels[2, 0] = 4
    nsp = torch.randint(0, 2, (6,), generator=gen)
    _same(PreTraining(), devices, ids, labels, nsp)


class SampleTokenMean(nn.Module):
    """A custom loss: the mean over samples of each sample's mean over its label tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(input_ids))
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        mask = (labels != -100).float()
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_a_mean_over_samples_of_token_means(devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 11, (7, 6), generator=gen)
    labels = ids.clone()
    labels[:3, 2:] = -100  # short samples first: a token count would weigh them wrongly
    _same(SampleTokenMean(), devices, ids, labels)


class Boxes(nn.Module):
    """DETR-style: an L1 sum over the boxes of the batch over their count, counted in forward
    from the class labels (-1: no box in that slot)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, classes: torch.Tensor, boxes: torch.Tensor) -> Any:
        valid = classes >= 0
        count = valid.sum().clamp(min=1)
        pred = self.head(x)[valid]
        return F.l1_loss(pred, boxes[valid], reduction="sum") / count


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_a_sum_over_boxes_over_a_count_computed_in_forward(devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 5, generator=gen)
    classes = torch.randint(0, 3, (6, 3), generator=gen)
    classes[:3, 1:] = -1  # few boxes in the first images
    boxes = torch.rand(6, 3, 4, generator=gen)
    _same(Boxes(), devices, x, classes, boxes)


class Regularised(nn.Module):
    """A token sum over Trainer's num_items_in_batch plus a penalty on the weights alone
    (AdaLoRA's orthogonality penalty, weight decay written into the loss): the penalty counts
    once, whatever the count did to the other term."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        logits = self.head(self.emb(input_ids))
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        penalty = 0.1 * self.head.weight.pow(2).sum()
        return total / kwargs["num_items_in_batch"] + penalty


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_a_penalty_on_the_weights_counts_once(devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 11, (6, 5), generator=gen)
    labels = ids.masked_fill(torch.rand(6, 5, generator=gen) < 0.3, -100)
    count = torch.tensor(int((labels != -100).sum()))
    _same(Regularised(), devices, ids, labels, num_items_in_batch=count)


class CountedRegression(nn.Module):
    """A squared error summed over the chunk and divided by Trainer's num_items_in_batch, of
    float inputs alone (only the count is marked, not the data), plus a penalty on the
    weights: the count's part is one loss term among others, so the penalty counts once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, num_items_in_batch: Any) -> Any:
        error = (self.head(x) - y).pow(2).sum() / num_items_in_batch
        return error + 0.1 * self.head.weight.pow(2).sum()


@pytest.mark.parametrize("devices", DEVICES, ids=len)
@pytest.mark.parametrize("kind", [int, torch.tensor])
def test_a_penalty_beside_a_count_scaled_sum_of_floats_counts_once(
    devices: list[str], kind: Callable[[int], Any]
) -> None:
    """Before issue 59's one mechanism, everything computed from the count was summed: the
    penalty came back once per replica."""
    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
    _same(CountedRegression(), devices, x, y, num_items_in_batch=kind(18))


class ClassSums(nn.Module):
    """Per-class squared-error sums over the count, weighed by a plain vector (``@``): a
    tensor computed from the count that is not one number stays a part, summed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, num_items_in_batch: Any) -> Any:
        per_class = (self.head(x) - y).pow(2).sum(0) / num_items_in_batch
        return torch.tensor([1.0, 2.0, 0.5]) @ per_class


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_a_per_class_part_of_the_count_weighed_by_a_vector(devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(10)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
    _same(ClassSums(), devices, x, y, num_items_in_batch=torch.tensor(18))


def test_a_chunk_mean_beside_a_count_scaled_sum_is_told_and_kept_as_a_mean() -> None:
    """A term of the chunk's data added to the count's part is not a part of it: told, and
    kept as its chunk-size mean (exact for this mean over samples); before, summed."""

    class WithMean(CountedRegression):
        def forward(self, x: torch.Tensor, y: torch.Tensor, num_items_in_batch: Any) -> Any:
            return super().forward(x, y, num_items_in_batch) + x.abs().mean()

    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
    model = WithMean()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = dp.DataParallel(model, ["cpu", "cpu"])(x, y, num_items_in_batch=18)
    told = [str(w.message) for w in caught if "cannot be re-formed" in str(w.message)]
    assert len(told) == 1 and "a term added that differs between chunks" in told[0], told
    assert_close_rel(got, model(x, y, num_items_in_batch=18), msg="loss")


# -- told: what cannot be re-formed -----------------------------------------------------------


class RouterLoss(nn.Module):
    """A token mean plus a product of two means (an MoE's load-balancing loss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(x)
        ce = F.cross_entropy(logits, labels)
        share = F.mse_loss(logits.softmax(-1), F.one_hot(labels.clamp(min=0), 3).float())
        return {"loss": ce + 0.01 * ce * share}


class ItemCount(nn.Module):
    """A sum over boxes divided by the chunk's own box count turned into a Python number."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        count = max((labels >= 0).sum().item(), 1)
        return {"loss": F.cross_entropy(self.head(x), labels, reduction="sum") / count}


@pytest.mark.parametrize(
    ("make", "what"),
    [(RouterLoss, "a product of two loss terms"), (ItemCount, "a Python number that differs")],
)
def test_what_cannot_be_re_formed_is_told_once_per_place(
    make: Callable[[], nn.Module], what: str
) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 4, generator=gen)
    labels = torch.randint(0, 3, (6,), generator=gen)
    labels[:2] = -100
    wrapped = dp.DataParallel(make(), ["cpu", "cpu"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = wrapped(x, labels)["loss"]
    told = [str(w.message) for w in caught if "cannot be re-formed" in str(w.message)]
    assert len(told) == 1, told
    assert told[0].startswith("output['loss']: ") and what in told[0]
    assert "scalar_weights=" in told[0]
    assert out.shape == () and torch.isfinite(out)
    if make is RouterLoss:  # a one-value loss: by how much another weighing could move it
        assert "(the chunks' values are " in told[0] and "otherwise, up to " in told[0]


def test_scalar_weights_are_called_only_when_a_mean_needs_them() -> None:
    """The guide's own example reads labels: an evaluation call without them has no loss to
    weigh, so it is never called (before: KeyError from inside the pipeline)."""

    class Maybe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 1)

        def forward(self, pixel_values: torch.Tensor, labels: Any = None) -> dict[str, Any]:
            logits = self.conv(pixel_values)
            if labels is None:
                return {"logits": logits}
            return {"loss": F.cross_entropy(logits, labels, ignore_index=255), "logits": logits}

    weights = lambda a, kw: (kw["labels"] != 255).sum()  # noqa: E731
    wrapped = dp.DataParallel(Maybe(), ["cpu", "cpu"], scalar_weights=weights)
    images = torch.randn(4, 3, 2, 2)
    assert wrapped(images)["logits"].shape == (4, 5, 2, 2)
    labels = torch.randint(0, 5, (4, 2, 2))
    labels[:2] = 255
    labels[0, 0, 0] = 1
    out = wrapped(images, labels=labels)["loss"]
    assert_close_rel(out, wrapped.module(images, labels=labels)["loss"])


def test_explain_says_how_scalar_outputs_are_gathered() -> None:
    notes = (
        dp.DataParallel(Segmenter(), ["cpu", "cpu"])
        .explain(torch.randn(4, 3, 2, 2), torch.zeros(4, 2, 2, dtype=torch.long))
        .notes
    )
    assert any(n.startswith("scalar outputs: ") and "re-formed" in n for n in notes)
    weighted = dp.DataParallel(Segmenter(), ["cpu", "cpu"], scalar_weights=lambda a, kw: 1)
    assert not weighted.explain(torch.randn(4, 3, 2, 2), torch.zeros(4, 2, 2)).notes
    # a call of floats alone marks nothing: its scalars are chunk-size means, no note
    plain_call = dp.DataParallel(Segmenter(), ["cpu", "cpu"])
    assert not plain_call.explain(torch.randn(4, 3, 2, 2), torch.rand(4, 2, 2)).notes


class Reported(nn.Module):
    """A loss with a penalty, an accuracy and a count of correct predictions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(x)
        right = logits.argmax(-1) == labels
        loss = F.cross_entropy(logits, labels) + 0.1 * self.head.weight.square().sum()
        return {"loss": loss, "acc": right.float().mean(), "right": right.sum(), "x": logits}


def test_explain_says_per_scalar_output_how_the_calls_gathered_it() -> None:
    """Before a call nothing is known of forward's outputs; after one, explain names each
    scalar output and its rule (issue 59), and the last call's word for a path stands."""
    x, labels = torch.randn(6, 4), torch.randint(0, 3, (6,))
    wrapped = dp.DataParallel(Reported(), ["cpu", "cpu"])
    assert not any("as gathered so far" in n for n in wrapped.explain(x, labels).notes)
    wrapped(x, labels)
    said = [n for n in wrapped.explain(x, labels).notes if "as gathered so far" in n]
    assert len(said) == 1, said
    assert "output['loss']: re-formed over the whole batch, term by term: a mean " in said[0]
    assert "+ a constant (once)" in said[0]
    assert "output['acc']: averaged, each chunk weighed by its size" in said[0]
    assert "output['right']: summed (a count)" in said[0]
    assert "output['x']" not in said[0]  # a batched output is no scalar
    with pytest.warns(UserWarning, match="cannot be re-formed"):
        told = dp.DataParallel(RouterLoss(), ["cpu", "cpu"])
        told(x, labels)
    note = [n for n in told.explain(x, labels).notes if "as gathered so far" in n]
    assert "output['loss']: the chunk-size mean, told at the call: a product" in note[0]
    weighed = dp.DataParallel(Reported(), ["cpu", "cpu"], scalar_weights=lambda a, kw: 2)
    weighed(x, labels)
    note = [n for n in weighed.explain(x, labels).notes if "as gathered so far" in n]
    assert "output['loss']: averaged, each chunk weighed by scalar_weights=" in note[0]
    assert not any("as gathered so far" in n for n in weighed.explain(x[:1], labels[:1]).notes)


def test_a_wrapper_from_before_the_record_explains_after_its_next_call() -> None:
    """A wrapper unpickled from a version without the per-output record (no ``_said``) gets
    one at its next gathered call, and explain then names the outputs."""
    x, labels = torch.randn(6, 4), torch.randint(0, 3, (6,))
    wrapped = dp.DataParallel(Reported(), ["cpu", "cpu"])
    del wrapped.__dict__["_said"]
    wrapped(x, labels)
    said = [n for n in wrapped.explain(x, labels).notes if "as gathered so far" in n]
    assert len(said) == 1 and "output['right']: summed (a count)" in said[0], said


class HandTokenMean(nn.Module):
    """A token mean written by hand: picked log-probabilities summed over the label tokens,
    over their count (no torch loss function builds it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logp = self.head(self.emb(input_ids)).log_softmax(-1)
        keep = labels != -100
        picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return -(picked * keep).sum() / keep.sum()


@pytest.mark.parametrize("devices", DEVICES, ids=len)
def test_a_sum_written_by_hand_over_a_count_of_the_data(devices: list[str]) -> None:
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 11, (7, 6), generator=gen)
    labels = ids.masked_fill(torch.rand(7, 6, generator=gen) < 0.4, -100)
    labels[:3, 1:] = -100
    _same(HandTokenMean(), devices, ids, labels)


@pytest.mark.parametrize("scalars", ["sum", "stack"])
def test_scalars_sum_and_stack_still_decide(scalars: str) -> None:
    """scalars= other than "mean" asks for the chunks' own values: summed, or one per
    replica, as before."""
    feats, labels = _ctc_batch(6)
    model = CTC("mean")
    parts = [model(f, y)[0] for f, y in zip(feats.split(3), labels.split(3), strict=True)]
    got = dp.DataParallel(model, ["cpu", "cpu"], scalars=scalars)(feats, labels)[0]
    want = parts[0] + parts[1] if scalars == "sum" else torch.stack(parts)
    assert_close_rel(got, want)


def test_a_loss_changed_in_place_keeps_check_in_step() -> None:
    """Trainer scales the loss in place (``loss *= loss_scale``) before its backward: a view
    would lose check='s gradient hook there, its one-device copy would miss the optimizer
    step, and the next call would be reported as a difference (the HF corpus programs)."""
    model = Segmenter()
    ref = copy.deepcopy(model)
    wrapped = dp.DataParallel(model, ["cpu", "cpu"], check="raise")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    for n in (4, 6):  # a new signature each step: both calls are checked
        images = torch.randn(n, 3, 2, 2, generator=gen)
        labels = torch.randint(0, 3, (n, 2, 2), generator=gen)
        labels[0] = 255
        for m, o in ((wrapped, opt), (ref, ref_opt)):
            loss = m(images, labels=labels)["loss"]
            loss *= 1  # in place, as Trainer does
            loss.backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close_rel(p, q)


class PassThrough(nn.Module):
    """Returns its marked inputs as they came, at the places gather takes whole: per-sample
    records (a list of dicts), a list and a dict beside the logits."""

    def forward(self, ids: torch.Tensor, records: list[dict[str, Any]]) -> Any:
        return {"ids": ids, "records": records, "pair": [ids, ids + 1], "float": ids * 0.5}


def test_marked_inputs_come_back_plain() -> None:
    ids = torch.arange(6)
    records = [{"id": i, "w": torch.full((2,), float(i))} for i in range(6)]
    out = dp.DataParallel(PassThrough(), ["cpu", "cpu"])(ids, records)
    found = [out["ids"], *out["pair"], out["float"], *(r["w"] for r in out["records"])]
    assert [type(t) for t in found] == [torch.Tensor] * len(found)
    assert torch.equal(out["ids"], ids) and torch.equal(out["records"][3]["w"], records[3]["w"])
