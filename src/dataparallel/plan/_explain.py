"""The text of the plan's broadcast warning (batch rule 6): what was found, then the fixes.

Kept apart from ``plan.py``, which decides; this module only words the decision.
"""

from __future__ import annotations

from dataparallel.plan._program import Vote

__all__ = ["voters_phrase", "warning_text"]


def _and(names: list[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def warning_text(
    batch: int, how: str, voters: str, votes: list[Vote], mismatched: list[tuple[str, str]]
) -> str:
    """The broadcast warning: what was found, then the fixes, the likeliest reading first.

    An input whose size is not ``B`` is most often shared on purpose (a batch-1 prompt, a
    lookup table), so the first fix offered is to mark that very input ``dp.Shared``, which
    silences the warning; the other reading (the input is batched and ``B`` is wrong) follows.
    """
    found = "; ".join(f"{path} has {what}" for path, what in mismatched)
    paths = [path for path, _ in mismatched]
    one = len(paths) == 1
    these = _and(paths)
    wrong = []
    if how.startswith("vote"):
        names = sorted(
            {v.path for v in votes if v.size == batch}, key=[v.path for v in votes].index
        )
        wrong.append(
            f"wrap {_and(names)} in dp.Shared(...) if "
            f"{'it is' if len(names) == 1 else 'they are'} not batched"
        )
    wrong.append("pass the right batch_size=N")
    split = these if one else f"the batched one of {these}"
    wrong.append(f"wrap {split} in dp.Split(...) to make its size the batch size")
    return (
        f"{found}, not the batch size {batch} ({voters}), so {'it is' if one else 'they are'} "
        f"broadcast whole to every device. To fix: wrap {these} in dp.Shared(...) if "
        f"{'it is' if one else 'they are'} meant to be shared (this also silences the "
        f"warning); if {'it is' if one else 'they are'} batched instead, the batch size is "
        f"wrong: {', or '.join(wrong)}. dp.plan(...) or DataParallel.explain(...) shows "
        f"every vote."
    )


def voters_phrase(batch: int, how: str, votes: list[Vote]) -> str:
    """Who decided ``B``: ``"voted by args[0], kwargs['y']"`` or ``"set by batch_size="``."""
    if how.startswith("vote"):
        names = [v.path for v in votes if v.size == batch]
        return f"voted by {', '.join(names)}"
    return f"set by {how}"
