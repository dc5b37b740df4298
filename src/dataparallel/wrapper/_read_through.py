"""Read-through: the wrapper's attributes are its own, every other public name is the module's.

``AttributeError: 'DataParallel' object has no attribute 'config'`` is what torch's
``DataParallel`` answers for anything its module has (``config``, ``generate``, ``features``),
and code written for the plain model, transformers' ``Trainer`` among it, reads the model it
was given. So the wrapper reads through:

- **The wrapper's names** stay its own: what its class defines (``forward``, ``explain``,
  ``scatter``, ``gather``, ``last_call``, the options' properties, and every ``nn.Module``
  method: ``parameters``, ``state_dict``, ``to``, ``train``...), what it holds (its
  ``module``, ``device_ids``, ``output_device``, ``dim``, its options, ``training``), and
  every name that starts with ``_`` (each object's private state: torch's, the wrapper's, a
  framework's bookkeeping such as ``_is_accelerate_prepared``).
- **Reads** of any other name give the module's: ``w.config`` is ``w.module.config``;
  ``w.generate(...)`` is ``w.module.generate(...)``, the module itself on its own device, not
  split over the replicas (only a call of the wrapper, ``w(...)``, and the step methods are).
- **Writes** of such a name land on the module too (``w.features = nn.Sequential(...)``
  replaces the module's), so a later read, the module's forward and ``w.module`` agree; a
  write of one of the wrapper's names is the wrapper's (the options are checked as the
  constructor checks them). ``del`` follows the same rule.

``isinstance(w, nn.DataParallel)``, ``w.module``, ``state_dict()`` keys (``module.*``) and the
unwraps of transformers, accelerate and Lightning are unchanged: nothing here is patched.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["WRAPPER_NAMES", "names_of", "owns", "read_through"]

# What a built wrapper holds in its ``__dict__`` (or nn.Module's tables) as its own: torch's
# DataParallel attributes and this wrapper's options.
WRAPPER_NAMES = frozenset(
    {
        "module",
        "device_ids",
        "output_device",
        "dim",
        "src_device_obj",
        "options",
        "scalars",
        "gather_outputs",
        "scalar_weights",
        "output_rules",
        "compile_options",
        "training",
    }
)


def owns(wrapper: nn.Module, name: str) -> bool:
    """Whether ``name`` is the wrapper's own (see the module's docstring), not the module's."""
    if name.startswith("_") or name in WRAPPER_NAMES:
        return True
    d = wrapper.__dict__
    if name in d or hasattr(type(wrapper), name):
        return True
    return any(name in d.get(table, ()) for table in ("_parameters", "_buffers", "_modules"))


def wrapped(wrapper: nn.Module) -> nn.Module | None:
    """The wrapped module, or ``None`` while there is none (being built, being unpickled)."""
    modules = wrapper.__dict__.get("_modules")
    return None if modules is None else modules.get("module")


def read_through(wrapper: nn.Module, name: str, missing: AttributeError) -> Any:
    """``name`` read on the wrapped module, for a name the wrapper does not define.

    Raises:
        AttributeError: a private name, or one the module does not have either, naming both.
    """
    module = wrapped(wrapper)
    if module is None or owns(wrapper, name):
        raise missing
    try:
        return getattr(module, name)
    except AttributeError as exc:
        if not isinstance(getattr(type(module), name, None), property):
            raise AttributeError(
                f"'{type(wrapper).__name__}' object has no attribute {name!r}, and neither "
                f"has its module ({type(module).__name__}): names the wrapper does not define "
                f"are read on the module"
            ) from None
        raise exc  # a property of the module's that failed: its own error


def names_of(wrapper: nn.Module, own: list[str]) -> list[str]:
    """``dir(wrapper)``: its own names (``own``) and the module's public ones, which read
    through (tab completion shows ``w.generate``)."""
    module = wrapped(wrapper)
    extra = [] if module is None else [n for n in dir(module) if not n.startswith("_")]
    return sorted({*own, *extra})
