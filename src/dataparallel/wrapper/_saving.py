"""A wrapped peft model's ``state_dict``: said where it cannot be saved as an adapter.

The wrapper's ``state_dict`` keys are torch's ``module.*`` (the contract: checkpoints of
``torch.nn.DataParallel`` load both ways). peft saves an adapter by filtering a state dict for
its own keys, so ``PeftModel.save_pretrained(dir, state_dict=wrapper.state_dict())`` writes an
adapter with no tensor in it, and ``PeftModel.from_pretrained`` then loads the untrained one
with a warning only. transformers' ``Trainer`` does exactly that when handed the wrapper
(``trainer.save_model()`` and its checkpoints). Said once per wrapper, when its state dict is
read, with the saves that work.
"""

from __future__ import annotations

from typing import Any

from dataparallel._common.warn import warn_user

__all__ = ["is_peft_model", "warn_prefixed_adapter"]


def is_peft_model(module: Any) -> bool:
    """Whether ``module`` is one of peft's models (read by its class's package)."""
    return type(module).__module__.partition(".")[0] == "peft"


def warn_prefixed_adapter(wrapper: Any) -> None:
    """Warn once per wrapper, where its module is a peft model, that the ``module.*`` keys of
    its state dict save as an empty adapter, naming the saves that keep it."""
    state = wrapper.__dict__
    module = state.get("_modules", {}).get("module")
    if not is_peft_model(module):
        return
    warned = state.setdefault("_warned", set())
    if ("peft-state-dict",) in warned:
        return
    warned.add(("peft-state-dict",))
    warn_user(
        f"state_dict() of a DataParallel wrapping a peft {type(module).__name__}: its keys are "
        f"'module.*' (torch's DataParallel keys), which peft's save_pretrained(state_dict=...) "
        f"filters out, saving an adapter with no tensor (transformers' Trainer.save_model() and "
        f"its checkpoints do this when handed the wrapper). Save the adapter with "
        f"wrapper.module.save_pretrained(dir) (after trainer.train(), or from a callback's "
        f"on_save); dp.load_unwrapped cannot restore an empty adapter. Said once per wrapper"
    )
