"""A loss that is a mean over the chunk's own label tokens: weighed by their count.

transformers' models (and torch's ``CrossEntropyLoss`` at its defaults) take their loss as a
mean over the labels that are not ``-100``; a causal LM over the labels shifted by one (the
first position of a row is never a target). On several replicas each computes the mean over
its own chunk's label tokens, and chunks hold different numbers of them: a mean weighted by
chunk size is not the one-device loss. Weighted by each chunk's count of label tokens, it is,
and a chunk with none (its loss NaN) counts for nothing.

So a call that passes ``labels`` (by keyword, or at the position of ``forward``'s parameter of
that name) as an integer tensor weighs the ``"mean"`` of its numeric scalar outputs by each
chunk's count of labels other than ``-100``, counted as transformers' ``Trainer`` counts
``num_items_in_batch``: over ``labels[..., 1:]`` for a causal LM, over ``labels`` otherwise.
Where no label is ``-100`` and nothing is shifted, the counts are proportional to the chunk
sizes, and the mean is the one it always was. ``scalar_weights=`` replaces the rule, and an
output computed from ``num_items_in_batch`` is summed whatever the weights. The counts are read
only when a mean needs them (``gather``'s ``weigh``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dataparallel.wrapper._partial_sums import param_position

__all__ = ["IGNORE_INDEX", "LABELS", "label_weights", "labels_note", "shifts_labels"]

LABELS = "labels"
IGNORE_INDEX = -100  # torch's CrossEntropyLoss default, transformers' padding label

# Class names of causal LMs whose ``loss_type`` transformers leaves unset (``GPT2LMHeadModel``):
# their ``loss_function`` falls back to the causal LM's loss.
_CAUSAL_NAMES = ("LMHeadModel", "ForCausalLM")


def _labels_of(module: nn.Module, args: Any, kwargs: Any) -> torch.Tensor | None:
    """The chunk's ``labels``, where it is an integer tensor, else ``None``."""
    if isinstance(kwargs, Mapping) and LABELS in kwargs:
        value = kwargs[LABELS]
    else:
        if not isinstance(args, tuple) or not args:
            return None
        index = param_position(module, LABELS)
        if index is None or index >= len(args):
            return None
        value = args[index]
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return None
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        return None  # regression targets, multi-label floats, masks: no token to count
    return value


def shifts_labels(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers causal LM, whose loss skips each row's first label.

    As ``Trainer`` decides what ``num_items_in_batch`` counts: the loss function the model's
    ``loss_type`` names is the causal LM's, and the model is not an encoder-decoder (T5 shifts
    its decoder's inputs, not its labels). A loss function set on the model decides by itself;
    a model whose ``loss_type`` is unset counts as causal when its class is named as one
    (``GPT2LMHeadModel``). Never true without transformers imported.
    """
    utils = sys.modules.get("transformers.loss.loss_utils")
    if utils is None:
        return False
    causal = getattr(utils, "ForCausalLMLoss", None)
    mapping = getattr(utils, "LOSS_MAPPING", None)
    config = getattr(module, "config", None)
    if causal is None or not isinstance(mapping, Mapping) or config is None:
        return False
    if getattr(config, "is_encoder_decoder", False):
        return False
    own = getattr(module, "_loss_function", None)
    if own is not None:
        return own is causal
    loss_type = getattr(module, "loss_type", None)
    if loss_type is None:
        name = type(module).__name__
        base = getattr(module, "get_base_model", None)  # peft: the model it adapts
        if callable(base):
            name = type(base()).__name__
        return name.endswith(_CAUSAL_NAMES)
    return mapping.get(loss_type) is causal


def label_weights(
    module: nn.Module, args: Sequence[Any], kwargs: Sequence[Any]
) -> Callable[[], list[float] | None] | None:
    """Each chunk's weight in the ``"mean"`` of scalar outputs, read when called: its count of
    label tokens; ``None`` (no function) for a call that passes no integer ``labels``.

    ``args`` and ``kwargs`` are each chunk's, as its replica received them. The function
    returns ``None`` (the chunk sizes stay) if a chunk has no such labels.
    """
    if not args or _labels_of(module, args[0], kwargs[0]) is None:
        return None

    def weigh() -> list[float] | None:
        shift = shifts_labels(module)
        counts = []
        for a, kw in zip(args, kwargs, strict=True):
            labels = _labels_of(module, a, kw)
            if labels is None:
                return None
            if shift and labels.ndim >= 2:
                labels = labels[..., 1:]
            counts.append(labels.ne(IGNORE_INDEX).sum())
        if len({c.device for c in counts}) > 1:
            counts = [c.cpu() for c in counts]
        return [float(c) for c in torch.stack(counts).tolist()]  # one sync

    return weigh


def labels_note(module: nn.Module) -> str:
    """What ``explain`` says about a call that passes integer ``labels``."""
    counted = "labels[..., 1:] (a causal LM)" if shifts_labels(module) else "labels"
    return (
        f"labels: the mean of numeric scalar outputs (a loss) is weighed by each chunk's "
        f"count of {counted} other than {IGNORE_INDEX}, so a loss that is a mean over the "
        f"chunk's label tokens gathers to the one-device mean; a chunk with none counts for "
        f"nothing (scalar_weights= replaces this rule)"
    )
