"""Warnings that point at the user's line, however deep in the library they are raised.

A fixed ``stacklevel`` is right for one call path only: ``dp.scatter`` called directly, through
``scatter_kwargs`` or through ``DataParallel.forward`` (itself under ``nn.Module.__call__``)
put the user's frame at different depths, and gather warns from inside a recursive walk.
:func:`warn_user` counts the frames instead: the first one outside this package and torch's
``nn.Module`` machinery is the user's, and Python's filter then shows each warning once per
user line.
"""

from __future__ import annotations

import os
import sys
import warnings

from torch import nn

__all__ = ["warn_user"]

# Frames in these folders are ours (the package's, this module being one folder down) or torch's
# module machinery.
_INTERNAL = (
    os.path.dirname(os.path.dirname(__file__)),
    os.path.dirname(nn.Module.__call__.__code__.co_filename),
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside dataparallel
    and torch's ``nn.Module`` (the line of user code that called into the library)."""
    frame = sys._getframe(1)
    level = 2  # 1 is this function, 2 its caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
