"""``dataparallel._common.warn``: a warning points at the user's line, however deep it was raised.

The same warning is raised through call paths of different depths (``dp.scatter`` directly,
``scatter_kwargs``, ``DataParallel.forward`` under ``nn.Module.__call__``); each must name this
file and the line of the call, and Python's filter must then show it once per line.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp
from dataparallel._common.warn import warn_user

CPU2 = ["cpu", "cpu"]


def _args() -> tuple[torch.Tensor, Any]:
    # A tensor of 4 beside a Split of 3: the tensor is broadcast, with a warning.
    return torch.zeros(4, 2), dp.Split(torch.zeros(3, 2))


class Identity(nn.Module):
    def forward(self, *args: Any) -> Any:
        return args[1]


def _record(call: Callable[[], object]) -> list[warnings.WarningMessage]:
    """The warnings ``call`` raises, every one shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return list(caught)


@pytest.mark.parametrize(
    "path",
    [
        lambda: dp.scatter(_args(), CPU2),
        lambda: dp.scatter_kwargs(_args(), None, CPU2),
        lambda: dp.DataParallel(Identity(), CPU2)(*_args()),
    ],
    ids=["scatter", "scatter_kwargs", "DataParallel"],
)
def test_a_library_warning_names_the_users_line(path: Callable[[], object]) -> None:
    caught = _record(path)
    assert caught, "the broadcast warning was expected"
    # The lambda is the user's code here: every path, deep or shallow, lands on its line.
    assert {w.filename for w in caught} == {__file__}
    assert {w.lineno for w in caught} == {path.__code__.co_firstlineno}


def test_warn_user_called_from_user_code_names_the_caller() -> None:
    line = sys._getframe().f_lineno + 1
    caught = _record(lambda: warn_user("look here", RuntimeWarning))
    assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, "look here")]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_the_default_filter_shows_a_warning_once_per_user_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            dp.scatter(_args(), CPU2)  # one line, three calls: one warning
        dp.scatter(_args(), CPU2)  # another line: another warning
    assert len(caught) == 2
    assert caught[0].lineno != caught[1].lineno
