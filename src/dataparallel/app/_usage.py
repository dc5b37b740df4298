"""argparse with the house's usage errors, and the typed options of the command line.

:class:`Parser` turns every usage error into one line, raised as :class:`UsageParseError` (the
command line prints it and exits 2), saying what was found, what was expected and the fix, with
"did you mean" where a close name exists (difflib), and refuses abbreviated options
(``allow_abbrev=False``: ``train --epoch 3`` is not read as ``--epochs``). The ``type=``
converters below give each option's two errors ("expected X, got Y; fix: ...").
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = [
    "FOLDER_MADE",
    "PROG",
    "SEED_LIMIT",
    "Parser",
    "UsageParseError",
    "int_at_least",
    "momentum",
    "path_of",
    "positive_float",
    "seed",
]

PROG = "dataparallel"


class UsageParseError(Exception):
    """Raised by the parser instead of printing usage and exiting (one line, exit 2)."""


class Parser(argparse.ArgumentParser):
    """argparse's parser with the house's errors: one line, what was found, what was expected
    and the fix, "did you mean" where a close name exists; abbreviations are refused (each
    subcommand's parser is one of these too, made with ``allow_abbrev=False``)."""

    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage and exits; we want one line, so raise instead. A
        # subcommand's errors name it ("train: ..."); the top level's need no name, as the line
        # already starts with "dataparallel: error:". argparse's own messages (a missing
        # value, two exclusive options) say what is wrong but no fix: point at the help.
        if message.endswith("expected one argument"):
            message += ", got none; fix: give it a value"
        elif " not allowed with argument " in message:
            message += "; expected one of the two, got both; fix: pass only one of the two"
        if "fix:" not in message:
            message += f"; fix: see `{self.prog} -h`"
        raise UsageParseError(self._where(message))

    def _where(self, message: str) -> str:
        where = self.prog.removeprefix(PROG).strip()
        return f"{where}: {message}" if where else message

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # A mistyped --strategy or command: argparse lists the choices but offers no fix.
        choices = action.choices
        if choices is None or value in choices:
            return
        names = [str(c) for c in choices]
        if isinstance(action, argparse._SubParsersAction):
            found = _unknown(str(value), names, f"a command: {_or(names)}", "dataparallel {} ...")
        else:
            flag = "/".join(action.option_strings)
            found = f"{flag}: {_unknown(str(value), names, _or(names), flag + ' {}')}"
        raise UsageParseError(self._where(found))

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        # argparse reports unknown arguments at the top level, whichever command they follow:
        # name them against that command's own options.
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            parser = self._commands().get(command, self) if command else self
            raise UsageParseError(parser._where(parser._unrecognized(extra)))
        return parsed

    def _commands(self) -> dict[str, Parser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def _unrecognized(self, extra: list[str]) -> str:
        flags = [a for a in extra if a.startswith("-")]
        if not flags:
            return (
                f"expected options only, got the extra argument(s) {' '.join(extra)!r}; fix: "
                f"drop them, or quote a value that holds spaces (see `{self.prog} -h`)"
            )
        found = flags[0].split("=", 1)[0]
        commands = self._commands()
        if commands:  # the top level: options belong after their command
            for name, sub in commands.items():
                close = _closest(found, sub._long_options())
                if close:
                    meant = _or([f"`{PROG} {name} {c} ...`" for c in close])
                    return (
                        f"unknown option {found}: expected a command first ({_or(list(commands))}) "
                        f"or --version, got {found!r}; fix: did you mean {meant}?"
                    )
            return (
                f"unknown option {found}: expected a command ({_or(list(commands))}) or "
                f"--version, got {found!r}; fix: `{PROG} -h` lists the commands"
            )
        options = self._long_options()
        close = _closest(found, options)
        if close:
            return (
                f"unknown option {found}: expected one of {self.prog}'s options, got "
                f"{found!r}; fix: did you mean {_or([repr(c) for c in close])}?"
            )
        return (
            f"unknown option {found}: expected one of {', '.join(options)}, got {found!r}; "
            f"fix: see `{self.prog} -h`"
        )

    def _long_options(self) -> list[str]:
        return sorted(
            o for o in self._option_string_actions if o.startswith("--") and o != "--help"
        )


_CLOSE = 0.8
"""How alike an unknown option must be to a real one to be offered (``--epoch``: ``--epochs``
0.93; ``--bogus``: ``--out`` 0.67, not offered)."""


def _closest(found: str, options: Sequence[str]) -> list[str]:
    """The options ``found`` most likely meant: those it abbreviates (``--batch``:
    ``--batch-size`` and ``--batchnorm``), else the closest by difflib, if close enough; none
    when nothing is close."""
    longer = [o for o in options if o.startswith(found)]
    if longer:
        return longer
    return difflib.get_close_matches(found, options, n=1, cutoff=_CLOSE)


def _or(names: Sequence[str]) -> str:
    """``"dp or ddp"``, ``"train, explain or bench"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _unknown(found: str, names: Sequence[str], wanted: str, usage: str = "") -> str:
    """ "expected X, got 'y'; fix: did you mean 'z'?", naming the closest of ``names``
    (difflib) where one is close; ``usage`` shows the fix in use (``{}`` is the name)."""
    close = difflib.get_close_matches(found, names, n=1, cutoff=0.6)
    if close:
        fix = f"did you mean {close[0]!r}?"
        if usage:
            fix += f" ({usage.format(close[0])})"
    else:
        fix = f"pass {wanted.removeprefix('a command: ')}"
    return f"expected {wanted}, got {found!r}; fix: {fix}"


def _checked(
    convert: Callable[[str], Any],
    noun: str,
    ok: Callable[[Any], bool],
    expected: str,
    *,
    fix: str = "",
    show_text: bool = False,
) -> Callable[[str], Any]:
    """An argparse ``type=``: ``convert`` the text, then require ``ok(value)``.

    Each option's two errors say "expected X, got Y" and then ``fix``; ``show_text`` quotes the
    text as typed in the second one (``'1e400'``, not ``inf``).
    """

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}{fix}") from None
        if not ok(value):
            got = text if show_text else value
            raise argparse.ArgumentTypeError(f"expected {expected}, got {got!r}{fix}")
        return value

    return parse


def int_at_least(low: int) -> Callable[[str], Any]:
    return _checked(int, "an integer", lambda v: v >= low, f"an integer >= {low}")


positive_float = _checked(
    float,
    "a number",
    lambda v: v > 0 and math.isfinite(v),  # NaN fails both
    "a finite number > 0",
    fix="; fix: pass a number such as 0.01",
    show_text=True,
)

SEED_LIMIT = 2**63
"""Seeds are 0 <= seed < 2**63: torch's generators take 64 bits, and each epoch adds its index."""

seed = _checked(
    int,
    "an integer",
    lambda v: 0 <= v < SEED_LIMIT,
    "an integer in 0..2**63-1",
    fix="; fix: pass a seed such as 0",
)
momentum = _checked(float, "a number", lambda v: 0 <= v < 1, "a number in [0, 1)")


def path_of(example: str) -> Callable[[str], Any]:
    """A file path option: an empty one is an error, not "none" (a shell variable that was
    never set, ``--json "$OUT"``, would otherwise skip the output without a word)."""
    return _checked(
        str,
        "a file path",
        lambda v: bool(v.strip()),
        "a file path",
        fix=f"; fix: pass a path such as {example}, or leave the option out",
    )


FOLDER_MADE = "a missing folder is created"
