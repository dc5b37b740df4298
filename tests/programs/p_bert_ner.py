"""kamalkraj's BERT-NER: a token classifier whose loss, inside forward, is a mean over the
active labelled tokens, and whose logits are gathered word by word.

Source: kamalkraj/BERT-NER run_ner.py

Ported: ``Ner(BertForTokenClassification)`` (the first sub-token of each word moved to the
front by the ``valid_ids`` loop, dropout, the classifier, ``CrossEntropyLoss(ignore_index=0)``
over the positions ``attention_mask_label`` marks; the loss returned alone when labels are
given, else the logits), the training step (``model(input_ids, segment_ids, input_mask,
label_ids, valid_ids, l_mask)``, ``loss.mean()`` as the script takes it for several GPUs,
AdamW) and the evaluation call without labels (``argmax`` of the log-softmax). The loss is a
mean over each chunk's own count of labelled tokens, so the port gives the wrapper that count
as ``scalar_weights`` (the guide's way for a loss computed inside forward), reading the
positional ``label_ids`` and ``l_mask`` (weight 1 on the evaluation call, whose logits are
not scalars).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dataparallel as dp

from ._hf import VOCAB, bert_config, transformers

NUM_LABELS, SEQ, BATCH = 5, 10, 6


class Ner(transformers.BertForTokenClassification):  # type: ignore[misc]
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        valid_ids: torch.Tensor | None = None,
        attention_mask_label: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sequence_output = self.bert(input_ids, token_type_ids, attention_mask, head_mask=None)[0]
        batch_size, max_len, feat_dim = sequence_output.shape
        valid_output = torch.zeros(
            batch_size, max_len, feat_dim, dtype=torch.float32, device=sequence_output.device
        )
        for i in range(batch_size):
            jj = -1
            for j in range(max_len):
                if valid_ids[i][j].item() == 1:  # type: ignore[index]
                    jj += 1
                    valid_output[i][jj] = sequence_output[i][j]
        sequence_output = self.dropout(valid_output)
        logits = self.classifier(sequence_output)
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss(ignore_index=0)
            if attention_mask_label is not None:
                active_loss = attention_mask_label.view(-1) == 1
                active_logits = logits.view(-1, self.num_labels)[active_loss]
                active_labels = labels.view(-1)[active_loss]
                return loss_fct(active_logits, active_labels)
            return loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
        return logits


def build() -> nn.Module:
    torch.manual_seed(0)
    return Ner(bert_config(num_labels=NUM_LABELS))


def _labelled(args: Any, kwargs: Any) -> Any:
    """Each chunk's count of the tokens its loss averages over: active and not label 0."""
    if len(args) < 6:
        return 1  # the evaluation call: logits, no scalar to weigh
    labels, l_mask = args[3], args[5]
    return ((l_mask == 1) & (labels != 0)).sum()


def wrap(model: nn.Module, devices: list[str]) -> Any:
    return dp.DataParallel(model, devices, scalar_weights=_labelled)


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=5e-3)]


def batches() -> list[Any]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        input_ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=gen)
        lengths = torch.randint(4, SEQ + 1, (BATCH,), generator=gen)
        input_mask = (torch.arange(SEQ) < lengths[:, None]).long()
        valid_ids = (torch.rand(BATCH, SEQ, generator=gen) < 0.7).long() * input_mask
        valid_ids[:, 0] = 1
        words = valid_ids.sum(1)
        l_mask = (torch.arange(SEQ) < words[:, None]).long()
        label_ids = torch.randint(0, NUM_LABELS, (BATCH, SEQ), generator=gen) * l_mask
        segment_ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        out.append((input_ids, segment_ids, input_mask, label_ids, valid_ids, l_mask))
    return out


def step(
    model: Any, run: Any, batch: Any, opts: Any, memo: dict[str, Any]
) -> dict[str, torch.Tensor]:
    (optimizer,) = opts
    input_ids, segment_ids, input_mask, label_ids, valid_ids, l_mask = batch
    model.train()
    loss = run(input_ids, segment_ids, input_mask, label_ids, valid_ids, l_mask)
    loss = loss.mean()  # mean() to average on multi-gpu.
    loss.backward()
    optimizer.step()
    model.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = run(
            input_ids, segment_ids, input_mask, valid_ids=valid_ids, attention_mask_label=l_mask
        )
    predicted = torch.argmax(torch.log_softmax(logits, dim=2), dim=2)
    return {"loss": loss.detach(), "logits": logits, "predicted": predicted}
