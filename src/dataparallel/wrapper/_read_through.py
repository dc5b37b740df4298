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
unwraps of transformers, accelerate and Lightning are unchanged: nothing here is patched. The
names a peft model's class defines are the module's too, though the wrapper of one is an
instance of that class (``dataparallel.wrapper._peft_class``).

:class:`ModuleNames` is the wrapper's attribute access under these rules, a base of
``DataParallel``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dataparallel.wrapper._options import CHECKED
from dataparallel.wrapper._peft_class import SHADOWED

__all__ = ["WRAPPER_NAMES", "ModuleNames", "names_of", "owns", "read_through"]

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
    if name in type(wrapper).__dict__.get(SHADOWED, ()):
        return False  # a peft class's name on the wrapper of a peft model
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


class ModuleNames(nn.Module):
    """Attribute access of a wrapper: its own names, the module's for the rest (see the
    module's docstring). Options set on a built wrapper (``w.scalars = "sum"``,
    ``w.device_ids``, ``w.module``...) are checked as the constructor checks them."""

    def __getattr__(self, name: str) -> Any:
        """A name the wrapper does not define is the module's: ``w.config``, ``w.generate``."""
        try:
            # parameters, buffers, submodules: the wrapper's (nn.Module's own lookup, named: in
            # a peft model's wrapper, the peft class follows in the method order)
            return nn.Module.__getattr__(self, name)
        except AttributeError as missing:
            return read_through(self, name, missing)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_steps" in self.__dict__:  # built
            check = CHECKED.get(name)
            if check is not None:
                value = check(self, value)
            elif not owns(self, name):
                setattr(self._modules["module"], name, value)
                return
        nn.Module.__setattr__(self, name, value)

    def __dir__(self) -> list[str]:
        return names_of(self, list(nn.Module.__dir__(self)))

    def __delattr__(self, name: str) -> None:
        if "_steps" in self.__dict__ and not owns(self, name):
            delattr(self._modules["module"], name)  # read-through: the module's name
            return
        nn.Module.__delattr__(self, name)
