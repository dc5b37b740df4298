"""Losses that are means over the chunk's own label tokens (issue 49, item 1).

T5, BERT's masked LM and token classifier, GPT-2 and Llama each return the mean of their loss
over the labels that are not -100 (the causal LMs over the labels shifted by one), and ignore
``num_items_in_batch`` where Trainer passes it (T5, BERT). The wrapper weighs each chunk's mean
by its count of label tokens, so the gathered loss is the one-device loss, with or without
Trainer; a chunk with no label token (its loss NaN) counts for nothing. Each case is the same
model on one device, with padded and masked labels spread unevenly over the chunks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

from ._models import SEQ, VOCAB, tiny_gpt2, tiny_llama
from ._oracle import LAYOUTS, record
from .test_trainers import _restore_environment, _weights_equal

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

__all__ = ["_restore_environment"]  # the fixture, used here too

RTOL = 1e-5


def tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(4)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_ff=24,
        d_kv=8,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config)


def _bert_config(**extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )


def tiny_bert_mlm() -> nn.Module:
    from transformers import BertForMaskedLM

    torch.manual_seed(5)
    return BertForMaskedLM(_bert_config())


def tiny_bert_tokens() -> nn.Module:
    from transformers import BertForTokenClassification

    torch.manual_seed(6)
    return BertForTokenClassification(_bert_config(num_labels=4))


FAMILIES: dict[str, tuple[Callable[[], nn.Module], int]] = {
    # name: (model, number of label classes)
    "gpt2": (tiny_gpt2, VOCAB),
    "llama": (tiny_llama, VOCAB),
    "t5": (tiny_t5, VOCAB),
    "bert-mlm": (tiny_bert_mlm, VOCAB),
    "bert-tokens": (tiny_bert_tokens, 4),
}


def _batch(batch: int, classes: int, seed: int, empty: int | None = None) -> dict[str, Any]:
    """Ids with right padding, labels -100 on the padding and on a random third of the rest
    (masked-LM style), and, where ``empty`` is given, every label of the rows from it on -100:
    a last chunk with no label token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, SEQ), generator=gen)
    lengths = torch.randint(2, SEQ + 1, (batch,), generator=gen)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.randint(0, classes, (batch, SEQ), generator=gen)
    dropped = torch.rand(batch, SEQ, generator=gen) < 0.35
    labels = labels.masked_fill((mask == 0) | dropped, -100)
    if empty is not None:
        labels[empty:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _same_loss_and_grads(make: Callable[[], nn.Module], devices: list[str], data: Any) -> float:
    ref = make().eval()
    par = copy.deepcopy(ref)
    loss_ref = ref(**data).loss
    loss_par = dp.DataParallel(par, devices)(**data).loss
    assert torch.isfinite(loss_par), "a chunk with no label token made the loss NaN"
    worst = _rel(loss_par.detach(), loss_ref.detach())
    assert worst <= RTOL, f"loss {loss_par.item()} != one device's {loss_ref.item()}"
    loss_ref.backward()
    loss_par.backward()
    pairs = [
        (name, p.grad, q.grad)
        for (name, p), q in zip(ref.named_parameters(), par.parameters(), strict=True)
    ]
    # A gradient that is zero in exact arithmetic (an attention key's bias) is rounding noise:
    # each is compared relative to its own size, or to the model's largest, whichever is more.
    largest = max(float(g.abs().max()) for _, g, _ in pairs if g is not None)
    for name, want, got in pairs:
        if want is None:
            assert got is None, name
            continue
        scale = max(float(want.abs().max()), 1e-3 * largest)
        diff = float((got - want).abs().max()) / scale
        assert diff <= RTOL, f"{name}.grad differs by {diff} (relative)"
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_token_mean_loss_is_the_one_device_loss(
    family: str, devices: list[str], batch: int
) -> None:
    make, classes = FAMILIES[family]
    data = _batch(batch, classes, seed=11)
    counts = [int((row != -100).sum()) for row in data["labels"]]
    assert len(set(counts)) > 1  # a mean weighted by chunk size would not be exact
    record(f"label tokens {family} {len(devices)}x", _same_loss_and_grads(make, devices, data))


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_chunk_with_no_label_token_counts_for_nothing(
    family: str, devices: list[str], batch: int
) -> None:
    """The last chunk's rows are all -100: its own loss is NaN (0/0); one device's is not."""
    make, classes = FAMILIES[family]
    data = _batch(batch, classes, seed=12, empty=batch - 1 if len(devices) == 3 else 3)
    _same_loss_and_grads(make, devices, data)


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_a_count_the_model_ignores_keeps_the_token_mean(devices: list[str], batch: int) -> None:
    """T5 takes num_items_in_batch through **kwargs and ignores it: its loss is still
    weighed by label tokens (before: the chunk-size mean, 4.1489 against 4.1029)."""
    data = _batch(batch, VOCAB, seed=13)
    count = int((data["labels"] != -100).sum())
    ref = tiny_t5().eval()
    par = copy.deepcopy(ref)
    want = ref(**data, num_items_in_batch=count).loss
    got = dp.DataParallel(par, devices)(**data, num_items_in_batch=count).loss
    assert _rel(got.detach(), want.detach()) <= RTOL


class _Classifier(nn.Module):
    """A plain torch model that takes its labels by position: cross-entropy ignores -100."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return nn.functional.cross_entropy(logits, labels), logits


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
def test_labels_by_position_in_a_plain_module(devices: list[str], batch: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, 6, generator=gen)
    labels = torch.randint(0, 5, (batch,), generator=gen)
    labels[:2] = -100  # the first chunk holds fewer labels than its size
    ref = _Classifier()
    loss_ref, _ = ref(x, labels)
    loss, logits = dp.DataParallel(copy.deepcopy(ref), devices)(x, labels)
    assert logits.shape == (batch, 5)
    assert _rel(loss.detach(), loss_ref.detach()) <= RTOL


def test_scalar_weights_still_decide() -> None:
    """An explicit scalar_weights replaces the label rule: weights of 1 give the plain mean
    of the chunks' losses."""
    data = _batch(4, VOCAB, seed=14)
    model = tiny_bert_mlm().eval()
    parts = [model(**{k: v[i : i + 2] for k, v in data.items()}).loss for i in (0, 2)]
    got = dp.DataParallel(model, ["cpu", "cpu"], scalar_weights=lambda a, kw: 1)(**data).loss
    assert _rel(got.detach(), ((parts[0] + parts[1]) / 2).detach()) <= RTOL


# -- under Trainer ----------------------------------------------------------------------------


class _Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def _tokenizer() -> Any:
    """A word-level tokenizer built here (nothing downloaded), for the masked-LM collator."""
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, "[MASK]": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")),
        pad_token="[PAD]",
        mask_token="[MASK]",
    )


def _trainer_run(model: nn.Module, family: str, out: Path, batch: int) -> dict[str, Any]:
    seq2seq = family == "t5"
    cls = transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments
    args = cls(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        max_steps=3,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        label_names=["labels"],
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    collator: Any = None
    classes = FAMILIES[family][1]
    train = _batch(2 * batch, classes, seed=21, empty=2 * batch - 2)
    evaluation = _batch(batch + 2, classes, seed=22)
    if family == "bert-mlm":  # the collator masks and labels the tokens itself
        collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), seed=7)
        for data in (train, evaluation):
            data.pop("labels")
    trainer_cls = transformers.Seq2SeqTrainer if seq2seq else transformers.Trainer
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=_Rows(train),
        eval_dataset=_Rows(evaluation),
        data_collator=collator,
    )
    trainer.train()
    return {
        "trainer": trainer,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": trainer.evaluate()["eval_loss"],
    }


@pytest.mark.parametrize(("devices", "batch"), LAYOUTS)
@pytest.mark.parametrize("family", ["t5", "bert-mlm", "bert-tokens"])
def test_trainer_with_a_token_mean_loss(
    family: str, devices: list[str], batch: int, tmp_path: Path
) -> None:
    """Seq2SeqTrainer with T5, Trainer with BERT's masked LM (DataCollatorForLanguageModeling)
    and token classifier: logged losses, eval_loss and every trained weight are the one-device
    Trainer's (before: T5 4.1489 against 4.1029, BERT-MLM 3.9651 against 3.9356, a chunk with
    no label token logged 0.0)."""
    make = FAMILIES[family][0]
    ref_model = make()
    model = copy.deepcopy(ref_model)
    ref = _trainer_run(ref_model, family, tmp_path / "one", batch)
    par = _trainer_run(dp.DataParallel(model, devices), family, tmp_path / "par", batch)
    assert par["trainer"].model_accepts_loss_kwargs == ref["trainer"].model_accepts_loss_kwargs
    assert len(par["losses"]) == 3 and all(math.isfinite(v) for v in par["losses"])
    assert par["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    assert par["eval_loss"] == pytest.approx(ref["eval_loss"], rel=RTOL)
    _weights_equal(ref_model, model, f"Trainer {family} {devices}")
