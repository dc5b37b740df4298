"""``train_step``, ``val_step`` and ``test_step``: the step methods of mmcv's and mmengine's
models, forwarded by the wrapper as their own wrappers forward them.

mmcv 1.x's ``MMDataParallel.train_step(*inputs, **kwargs)`` scatters its arguments and calls
``module.train_step`` on the chunk (its models return ``dict(loss=..., log_vars=...,
num_samples=...)`` and leave the backward to a hook); ``val_step`` likewise. Here each replica
runs the module's method on its chunk, through the same plan, scatter and gather as
``forward``: ``wrapper.train_step(data, optimizer)`` is ``model.train_step`` on one device,
split. ``num_samples`` (each chunk's sample count, as mmcv's models return it) is summed.

mmengine's ``BaseModel.train_step(data, optim_wrapper)`` also runs the backward and the
optimizer step, which must happen once, not once per replica: its wrappers
(``MMDistributedDataParallel``) run the data preprocessor, then the wrapped forward in
``mode="loss"``, then ``parse_losses`` and ``optim_wrapper.update_params`` once. The wrapper
does the same when the module's ``train_step`` takes ``optim_wrapper``; its ``val_step`` and
``test_step`` (preprocess, predict) run per replica, their per-sample results gathered.

The attributes exist only where the module has the method (``hasattr(wrapper, "train_step")``
is the module's answer), as runners that look for them expect.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["STEP_METHODS", "StepCall", "StepMethod", "mmengine_train_step", "step_rules"]

STEP_METHODS = ("train_step", "val_step", "test_step")

_SPLIT = """Run the module's ``{name}`` split over the replicas, as ``forward`` runs.

Present only where the module has it (``hasattr(wrapper, "{name}")`` is the module's
answer). Each replica runs ``module.{name}`` on its chunk of the arguments, split by the
batch rules as a call's are; the outputs are gathered as a call's are, and ``num_samples``
(mmcv's per-chunk count) is summed.
{more}
Returns:
    The gathered output of ``module.{name}``.

Raises:
    AttributeError: the module has no ``{name}``.
"""
_STEP_DOCS = {
    "train_step": _SPLIT.format(
        name="train_step",
        more="\nmmengine's ``train_step(data, optim_wrapper)`` runs as its own wrappers run it:"
        "\nthe data preprocessor, the forward in ``mode='loss'`` over the replicas, then"
        "\n``parse_losses`` and ``optim_wrapper.update_params`` once; it returns ``log_vars``.\n",
    ),
    "val_step": _SPLIT.format(name="val_step", more="\nmmengine's preprocesses, then predicts.\n"),
    "test_step": _SPLIT.format(
        name="test_step", more="\nmmengine's preprocesses, then predicts.\n"
    ),
}


class StepMethod:
    """``wrapper.<name>``: the module's step method run through the pipeline, present only
    where the module has it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        # help() and the reference list it as a method, with its own text
        self.__name__ = self.__qualname__ = name
        self.__doc__ = _STEP_DOCS[name]

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        if wrapper is None:
            return self
        module = wrapper.__dict__.get("_modules", {}).get("module")
        if not callable(getattr(module, self.name, None)):
            # nn.Module.__getattr__ then raises its AttributeError: hasattr() is False
            raise AttributeError(self.name)
        if self.name == "train_step" and _takes_optim_wrapper(module):
            return functools.partial(mmengine_train_step, wrapper)
        return functools.partial(wrapper._run_step, self.name)


def _takes_optim_wrapper(module: nn.Module) -> bool:
    """mmengine's ``train_step(data, optim_wrapper)``, which steps the optimizer itself."""
    try:
        step: Any = getattr(module, "train_step", None)
        return "optim_wrapper" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False


class StepCall(nn.Module):
    """One replica's step method, as a module the pool runs like a replica (the replica is its
    child, so its parameters are found)."""

    def __init__(self, replica: nn.Module, name: str) -> None:
        super().__init__()
        self.replica = replica
        self.__dict__["_method"] = getattr(replica, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_method"](*args, **kwargs)


def step_rules(output: Any, rules: Mapping[str, int | str] | None) -> Mapping[str, Any] | None:
    """The gather rules for a step method's output: mmcv's ``num_samples`` is each chunk's
    sample count, summed (the user's own rule for it wins)."""
    if isinstance(output, Mapping) and "num_samples" in output:
        return {"output['num_samples']": "sum", **(rules or {})}
    return rules


def mmengine_train_step(wrapper: Any, data: Any, optim_wrapper: Any) -> Any:
    """mmengine's wrappers' ``train_step``: preprocess the batch, run the wrapper's forward in
    ``mode="loss"`` (split over the replicas, the losses gathered), then parse the losses and
    update the parameters once. Returns ``log_vars``, as mmengine's models do."""
    module = wrapper.module
    with optim_wrapper.optim_context(wrapper):
        data = module.data_preprocessor(data, training=True)
        if isinstance(data, Mapping):
            losses = wrapper(**data, mode="loss")
        elif isinstance(data, (list, tuple)):
            losses = wrapper(*data, mode="loss")
        else:
            raise TypeError(
                f"data: expected the data preprocessor to return a dict, list or tuple, got "
                f"{type(data).__name__}; return the model's forward arguments"
            )
    parsed, log_vars = module.parse_losses(losses)
    optim_wrapper.update_params(parsed)
    return log_vars
