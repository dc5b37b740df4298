"""Container subclasses whose constructors do not take their items first (issue 14).

Shared by the bad-input catalogue and the property tests: scatter and gather must keep their
items and attributes although ``type(obj)(items)`` would build them empty or fail.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class Named(list):  # type: ignore[type-arg]
    """A list whose constructor does not take its items first."""

    def __init__(self, name: str, items: Any = ()) -> None:
        super().__init__(items)
        self.name = name


class Batch(dict):  # type: ignore[type-arg]
    """A dict whose constructor takes metadata first and the items as keywords."""

    def __init__(self, meta: Any = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.meta = meta


class Ordered(OrderedDict):  # type: ignore[type-arg]
    """An OrderedDict with a tag before its items."""

    def __init__(self, tag: str, *args: Any) -> None:
        super().__init__(*args)
        self.tag = tag


class PairT(tuple):  # type: ignore[type-arg]
    """A tuple subclass with its own ``__new__``."""

    def __new__(cls, a: Any, b: Any) -> PairT:
        return super().__new__(cls, (a, b))
