"""The wrapper's ``forward`` presents the wrapped module's call signature to introspection.

Code that reads a model's signature (transformers' ``Trainer`` drops every dataset column that
``inspect.signature(model.forward)`` does not name; accelerate, PEFT and argument binders do
the same) sees ``DataParallel.forward(*inputs, **kwargs)`` otherwise, and filters every input
away. So ``inspect.signature(wrapper.forward)`` and ``inspect.signature(wrapper)`` name the
module's parameters instead (a peft model's: its base model's, as ``Trainer`` reads them).

``inspect.signature`` of a bound method reads its ``__func__``, which for a plain method is
the class's function, shared by every instance: a per-instance answer needs a per-instance
``__func__``. :class:`PresentedForward` is the class attribute ``forward``; on an instance it
binds a per-instance copy of the real forward function (same code, so the call and
``torch.compile`` see an ordinary function) whose ``__wrapped__`` leads ``inspect`` to a
``__signature__`` read lazily from ``wrapper.module.forward`` when asked: always the current
module, and nothing computed per call. The copy holds the wrapper only weakly (a strong
reference would make a cycle, and a dropped wrapper must be freed at once), and it is kept out
of pickles and deep copies, which make their own on first use.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from types import FunctionType, MethodType
from typing import Any

from dataparallel.wrapper._saving import is_peft_model

__all__: list[str] = []

# Where the per-instance callable lives in the wrapper's __dict__ (past nn.Module's setattr).
SLOT = "_presented_forward"


class _Signature:
    """Stands at the end of the per-instance forward's ``__wrapped__`` chain, where
    ``inspect`` reads ``__signature__``: the wrapped module's (with a leading ``self``, which
    ``inspect`` drops from a bound method), read when asked."""

    def __init__(self, func: Callable[..., Any], owner: Any) -> None:
        self.func = func
        self.owner = weakref.ref(owner)

    @property
    def __signature__(self) -> inspect.Signature:
        own = inspect.signature(self.func)  # (self, *inputs, **kwargs)
        wrapper = self.owner()
        module = None if wrapper is None else wrapper.__dict__.get("_modules", {}).get("module")
        if module is None:
            return own
        try:
            sig = inspect.signature(_inspected(module).forward)
        except (TypeError, ValueError):  # a builtin or C forward without a signature
            return own
        first = next(iter(own.parameters.values()))  # self, dropped from a bound method
        return sig.replace(parameters=[first, *sig.parameters.values()])


def _inspected(module: Any) -> Any:
    """The module whose ``forward`` tells which inputs ``module`` takes: a peft model's base
    model (its own forward takes ``*args, **kwargs``), as transformers' ``Trainer`` reads a
    peft model it is handed; the module itself otherwise."""
    if not is_peft_model(module):
        return module
    base = getattr(module, "get_base_model", None)  # (PeftMixedModel has none)
    if callable(base):
        return base()
    inner = getattr(getattr(module, "base_model", None), "model", None)
    return module if inner is None else inner


class PresentedForward:
    """A class attribute standing for ``forward``: the class sees the plain function (so
    subclasses, ``super().forward`` and ``torch.compile`` see an ordinary method), an instance
    a bound method whose signature is the wrapped module's."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __get__(self, obj: Any, owner: type | None = None, _bind: type = MethodType) -> Any:
        # The hot path (nn.Module.__call__ looks forward up on every call): one dict lookup
        # and a bound method, as for any method, plus this frame (about 0.1 µs).
        if obj is None:
            return self.func
        try:
            return _bind(obj.__dict__[SLOT], obj)
        except KeyError:
            return _bind(self.attach(obj), obj)

    def attach(self, obj: Any) -> FunctionType:
        """Make ``obj``'s per-instance forward, on its first use (also after unpickling)."""
        func = self.func
        forward = FunctionType(
            func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
        )
        forward.__kwdefaults__ = func.__kwdefaults__
        forward.__qualname__ = func.__qualname__
        forward.__doc__ = func.__doc__
        forward.__module__ = func.__module__
        forward.__wrapped__ = _Signature(func, obj)  # type: ignore[attr-defined]
        obj.__dict__[SLOT] = forward
        return forward


class PresentedSignature:
    """A class attribute ``__signature__``: ``inspect.signature(wrapper)`` is its forward's.

    On the class it is its ``__init__``'s, less ``self`` (``inspect`` would read the
    ``__new__`` that makes a peft model's wrapper of its class, which takes ``*args``)."""

    def __get__(self, obj: Any, owner: type | None = None) -> inspect.Signature | None:
        if obj is None:
            if owner is None:
                return None
            init = inspect.signature(owner.__init__)  # type: ignore[misc]
            return init.replace(parameters=list(init.parameters.values())[1:])
        try:
            return inspect.signature(obj.forward)
        except (TypeError, ValueError):
            return None
