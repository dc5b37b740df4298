"""A wrapped peft model's state dict: the peft model's own keys, so its saves keep the adapter.

The wrapper's ``state_dict`` keys are torch's ``module.*`` (the contract: checkpoints of
``torch.nn.DataParallel`` load both ways). peft saves an adapter by reading a state dict for
its own module names (``base_model.model...lora_A...``), so ``PeftModel.save_pretrained(dir,
state_dict=wrapper.state_dict())``, which transformers' ``Trainer`` calls when handed the
wrapper (``save_model`` and every checkpoint), wrote an adapter with no tensor, and
``PeftModel.from_pretrained`` then loaded the untrained one with a warning only.

The rule (the guide's "peft's state dict"): where the wrapped module is a peft model, the
wrapper's top-level ``state_dict()`` is the peft model's own, and its ``load_state_dict`` takes
that form or the ``module.*`` one. Called with a prefix (the wrapper held inside another
module), torch's ``module.*`` keys stay, so the outer module saves and loads as torch's does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["is_peft_model", "peft_load_state_dict", "peft_state_dict"]


def is_peft_model(module: Any) -> bool:
    """Whether ``module`` is one of peft's models (read by its class's package)."""
    return type(module).__module__.partition(".")[0] == "peft"


def _peft_module(wrapper: nn.Module) -> nn.Module | None:
    module = wrapper.__dict__.get("_modules", {}).get("module")
    return module if is_peft_model(module) else None


def peft_state_dict(
    wrapper: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The peft model's own state dict for a top-level ``wrapper.state_dict(...)`` call, or
    ``None`` (not a peft model, or a call with a prefix: torch's keys then)."""
    module = _peft_module(wrapper)
    prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
    if module is None or prefix:
        return None
    return dict(module.state_dict(*args, **kwargs))


def peft_load_state_dict(
    wrapper: nn.Module, state_dict: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Load the peft model's own keys into it (``args``, ``kwargs``: ``load_state_dict``'s
    ``strict`` and ``assign``), or ``None`` (not a peft model, or a state dict with
    ``module.*`` keys: torch's load then)."""
    module = _peft_module(wrapper)
    if module is None or any(key.startswith("module.") for key in state_dict):
        return None
    return module.load_state_dict(state_dict, *args, **kwargs)
