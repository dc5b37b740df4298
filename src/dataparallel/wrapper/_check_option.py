"""``check=``'s settings: the option, ``DATAPARALLEL_CHECK``, ``check_every``, and the warning
class a difference is reported as (the comparison itself is ``_one_device``)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["CHECK_ENV", "OneDeviceDifference", "check_every_option", "check_option"]

CHECK_ENV = "DATAPARALLEL_CHECK"

_TRUE = {"1", "true", "yes", "on", "warn"}
_FALSE = {"", "0", "false", "no", "off"}


class OneDeviceDifference(UserWarning):
    """A call through ``dp.DataParallel(..., check=True)`` differs from the same call on one
    device; raised instead of warned with ``check="raise"``.

    The message names the place (``output[1]``, ``buffer bn.running_mean``, ``grad of
    lin.weight``), the size of the difference relative to the values' magnitude, and the rule
    or option that explains or fixes it, or says that no rule covers it. A ``UserWarning``
    subclass, so Python's warning filters select it (``warnings.simplefilter("error",
    dp.OneDeviceDifference)``). The guide's "Checking against one device" says which calls
    are compared and what the check costs.

    Making one raises nothing: ``DataParallel`` warns it (``check=True``) or raises it
    (``check="raise"``) where a call differs.

    Args:
        args: the message, as for any ``Warning``.

    Example:
        A statistic over the batch inside forward is the chunk's, not the batch's:

        >>> import torch, dataparallel as dp
        >>> class Centre(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x - x.mean(0)
        >>> model = dp.DataParallel(Centre(), ["cpu", "cpu"], check="raise")
        >>> try:
        ...     model(torch.arange(8.0).reshape(4, 2))
        ... except dp.OneDeviceDifference as difference:
        ...     print("output" in str(difference))
        True
    """


def check_option(value: Any, *, where: str = "check") -> str | None:
    """The check's mode for ``check=``: ``"warn"``, ``"raise"`` or ``None`` (off). ``None``
    (not given) reads ``DATAPARALLEL_CHECK`` from the environment."""
    if value is None:
        env = os.environ.get(CHECK_ENV)
        return None if env is None else check_option(env.strip().lower(), where=CHECK_ENV)
    if value is True or (isinstance(value, str) and value in _TRUE):
        return "warn"
    if value is False or (isinstance(value, str) and value in _FALSE):
        return None
    if value == "raise":
        return "raise"
    raise ValueError(
        f"{where}: expected True, 'raise', False or None, got {value!r:.60}; check=True warns "
        f"OneDeviceDifference where a call differs from one device's, check='raise' raises it"
    )


def check_every_option(value: Any) -> int:
    """``check_every``: 0 (the first call of each signature and after each rebuild of the
    replicas) or N (also every N-th call; 1: every call)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"check_every: expected an int >= 0, got {value!r:.60}; 0 checks the first call "
            f"of each signature and after each rebuild of the replicas, 1 every call, N every "
            f"N-th call as well"
        )
    return value
