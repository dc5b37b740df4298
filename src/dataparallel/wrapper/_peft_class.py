"""A wrapped peft model is an instance of its peft class, so code that tells peft models by
``isinstance`` treats the wrapper as the peft model it runs.

transformers' ``Trainer`` tells a peft model by ``isinstance(model, PeftModel)`` only: it
resumes (``train(resume_from_checkpoint=...)``) and loads the best model by the model's
``load_adapter``, and reads the label names (``find_labels``) from the base model's class. The
wrapper of a peft model was none of that, like ``torch.nn.DataParallel`` around one: Trainer
looked for full weights in an adapter checkpoint ("Can't find a checkpoint index") and found no
label names (so ``evaluate`` gave no ``eval_loss``, and ``compute_metrics`` no labels).

So ``DataParallel(peft_model)`` is an instance of a class made once per peft class: its bases
are the wrapper's class, then the peft class. The wrapper's own names come first (its
``forward``, ``state_dict``, every ``nn.Module`` method); every other name the peft classes
define (``load_adapter``, ``get_base_model``, ``peft_config``, ``save_pretrained``...) is a
descriptor that reads, writes and deletes the wrapped module's (read-through, as for any name
the wrapper does not define): no peft code ever runs with the wrapper as its ``self``. The
class is named as the wrapper's (``type(w).__name__ == "DataParallel"``), pickles and copies as
a wrapper does, and follows the module: assigning ``w.module`` another model gives the wrapper
the class for it. The guide's "peft's state dict" says the rule.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import nn

from dataparallel.wrapper._saving import is_peft_model

__all__ = ["SHADOWED", "class_for"]

# The made class's attributes: its two bases, and the peft names that read through.
_BASE = "_peft_wrapper_base"
_PEFT = "_peft_class"
SHADOWED = "_peft_names"

# What a class records rather than defines: never shadowed or copied.
_LAYOUT = frozenset(
    {
        "__dict__",
        "__weakref__",
        "__module__",
        "__doc__",
        "__qualname__",
        "__annotations__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
        "__slotnames__",
        "__abstractmethods__",
        "_abc_impl",
    }
)

_MADE: dict[tuple[type, type], type] = {}
_MAKING = threading.Lock()


class ModuleName:
    """A peft class's name on a wrapper of one: the wrapped module's (read, written, deleted).

    On the class it is the peft class's own attribute, as inheritance would give."""

    def __init__(self, name: str, source: type) -> None:
        self.name = name
        self.source = source

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        if wrapper is None:
            return getattr(self.source, self.name)
        return getattr(_module(wrapper, self.name), self.name)

    def __set__(self, wrapper: Any, value: Any) -> None:
        setattr(_module(wrapper, self.name), self.name, value)

    def __delete__(self, wrapper: Any) -> None:
        delattr(_module(wrapper, self.name), self.name)


def _module(wrapper: Any, name: str) -> nn.Module:
    module = wrapper.__dict__.get("_modules", {}).get("module")
    if module is None:  # (being built or unpickled: nothing to read through yet)
        raise AttributeError(name)
    return module


def class_for(cls: type, module: Any) -> type:
    """The class a wrapper of ``module`` is made of: ``cls``'s plain class (``cls`` may be a
    made one), or, for a peft model, the class made for it and its peft class."""
    base: type = cls.__dict__.get(_BASE, cls)
    if not is_peft_model(module):
        return base
    return _made(base, type(module))


def _made(base: type, peft: type) -> type:
    """The class for ``base`` and ``peft``, made once."""
    made = _MADE.get((base, peft))
    if made is None:
        with _MAKING:
            made = _MADE.get((base, peft)) or _MADE.setdefault((base, peft), _make(base, peft))
    return made


def _make(base: type, peft: type) -> type:
    """The class whose bases are ``base`` (a wrapper class) and ``peft``; see the module's
    docstring. Each name the peft classes define is, in the made class's own namespace, the
    wrapper's where the wrapper's class defines it (so a peft override of an ``nn.Module``
    method, which the method order would put first, never runs on the wrapper) and the
    module's otherwise."""
    own: dict[str, Any] = {}
    for klass in reversed(base.__mro__):
        own.update(vars(klass))  # the wrapper's resolution of each of its names
    namespace: dict[str, Any] = {}
    shadowed: set[str] = set()
    for klass in peft.__mro__:
        if klass in nn.Module.__mro__:
            continue
        for name in vars(klass):
            if name in _LAYOUT or name in namespace:
                continue
            if name in own:
                namespace[name] = own[name]
            else:
                namespace[name] = ModuleName(name, peft)
                shadowed.add(name)
    namespace.update(
        {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "__reduce_ex__": _reduce_ex,
            _BASE: base,
            _PEFT: peft,
            SHADOWED: frozenset(shadowed),
        }
    )
    return type(base.__name__, (base, peft), namespace)


def _reduce_ex(wrapper: Any, protocol: Any) -> tuple[Any, ...]:
    """Pickles and copies rebuild the made class from its two bases (it cannot be found by
    name): otherwise as ``object.__reduce_ex__`` gives (the wrapper's ``__getstate__``)."""
    reduced = object.__reduce_ex__(wrapper, protocol)
    made = type(wrapper).__dict__
    return (_remade, (made[_BASE], made[_PEFT]), *reduced[2:])


def _remade(base: type, peft: type) -> Any:
    """An empty wrapper of the class made for ``base`` and ``peft`` (its state is set next)."""
    return object.__new__(_made(base, peft))
