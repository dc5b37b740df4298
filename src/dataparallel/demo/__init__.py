"""The demo behind ``dataparallel train``: datasets, the tutorial's models and the training
loop. It lives outside the library core; import its submodules directly
(``dataparallel.demo.data``, ``dataparallel.demo.models``, ``dataparallel.demo.train``)."""

from __future__ import annotations

__all__: list[str] = []
