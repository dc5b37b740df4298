"""The demo behind ``dataparallel train``, outside the library core.

Submodules: ``data`` (digits, CIFAR-10 folders, the tutorial's random data), ``models`` (the
tutorial's networks), ``options`` (options and results), ``train`` (the dp loop and the entry
points), ``ddp`` (the DDP loop), ``checkpoint`` (atomic save, exact resume) and ``report``
(what a person and a machine read at the end). Import them directly.
"""

from __future__ import annotations

__all__: list[str] = []
