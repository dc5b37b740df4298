"""The application built on the library: the ``dataparallel`` command (``cli``; its parser in
``_parser``, ``explain`` and ``bench`` in ``_commands``), its process launcher (``launch``), the
``explain`` scenarios and the training demo (``demo/``).

Nothing in the library core imports from here.
"""

from __future__ import annotations

__all__: list[str] = []
