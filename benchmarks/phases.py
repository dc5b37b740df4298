"""Where a warm two-replica call spends its time, phase by phase, beside the hand-written floor.

``python -m benchmarks.phases`` prints the table; ``case_phases`` (part of the full set) turns
it into cases. Each phase is timed where it runs, inside real calls (``time.perf_counter_ns``
around the function that does it, patched in for the measurement and restored after), because
the same Python costs two to three times more after a large forward has flushed the caches
than in a loop of its own.

Two passes per model and mode, each interleaved with the floor, the collector off:

- **totals**: only the call and the hand-off are wrapped, so the serial Python before the
  hand-off (from the call's entry to the first task handed to a worker) and after the join
  (from the last replica's end to the call's return) are timed with the least disturbance;
- **phases**: every step wrapped (scatter, replicate check, hand-off, gather; the kept plan's
  comparison and the record are inline in the warm call, ``wrapper._warm``, and count in the
  serial parts);
  the wrappers add a few tenths of a µs each, so these rows sum to a little more than the
  totals.

The floor (``benchmarks.e2e.Floor``) is timed the same way: its split before its first hand-off,
its concatenation after its last join. Both sides run the same module on the same batch.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.e2e import MODELS, Floor
from benchmarks.harness import Case, Settings, Stats
from dataparallel.wrapper import DataParallel

__all__ = ["PHASES", "SERIAL_TARGET", "case_phases", "main", "measure"]

SERIAL_TARGET = 2.0  # issue 43: serial Python before the hand-off within 2x the floor's

# (label, module, attribute path): the function that does each phase of a warm call.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("scatter", "dataparallel.scatter._cuts", "WaveCut.__call__"),
    ("replicate check", "dataparallel.replicate", "ReplicaSets.kept"),
    ("hand-off, forwards, join", "dataparallel.wrapper._warm", "apply_kept"),
    ("gather", "dataparallel.wrapper._warm", "concat_batched"),
)
_CALL = ("call", "dataparallel.wrapper._data_parallel", "DataParallel.__call__")
_HANDOFF = PHASES[2]

_ns = time.perf_counter_ns


class _Clock:
    """Accumulated ns per label, and the stamps that bound the serial parts of a call."""

    def __init__(self) -> None:
        self.total: dict[str, int] = {}
        self.before = 0  # call entry -> hand-off entry, summed
        self.after = 0  # hand-off exit -> call exit, summed
        self._entry = self._handed = self._joined = 0

    def clear(self) -> None:
        self.total.clear()
        self.before = self.after = 0


def _owner(module: str, path: str) -> tuple[Any, str]:
    obj: Any = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    return obj, name


@contextmanager
def _patched(clock: _Clock, phases: tuple[tuple[str, str, str], ...]) -> Iterator[None]:
    """Wrap each phase's function with a timer (and the call and hand-off with the stamps of
    the serial parts); restore them all on exit."""
    saved: list[tuple[Any, str, Any, bool]] = []

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        total = clock.total
        if label == "call":

            def call(*args: Any, **kwargs: Any) -> Any:
                clock._entry = start = _ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    end = _ns()
                    total["call"] = total.get("call", 0) + end - start
                    clock.after += end - clock._joined

            return call
        if label == _HANDOFF[0]:

            def handoff(*args: Any, **kwargs: Any) -> Any:
                clock._handed = start = _ns()
                clock.before += start - clock._entry
                try:
                    return fn(*args, **kwargs)
                finally:
                    clock._joined = end = _ns()
                    total[label] = total.get(label, 0) + end - start

            return handoff

        def phase(*args: Any, **kwargs: Any) -> Any:
            start = _ns()
            try:
                return fn(*args, **kwargs)
            finally:
                total[label] = total.get(label, 0) + _ns() - start

        return phase

    try:
        for label, module, path in phases:
            owner, name = _owner(module, path)
            own = name in vars(owner)
            original = getattr(owner, name)
            saved.append((owner, name, original, own))
            setattr(owner, name, timed(label, original))
        yield
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:  # inherited (nn.Module.__call__): remove the class's own wrapper
                delattr(owner, name)


class _TimedFloor(Floor):
    """The floor with the same two stamps: its split and hand-off, its join and concat."""

    def __init__(self, module: torch.nn.Module, n: int) -> None:
        super().__init__(module, n)
        self.before = self.after = self.split = self.cat = self.whole = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        start = _ns()
        chunks = torch.tensor_split(x, self.n)
        split = _ns()
        grad = torch.is_grad_enabled()
        handed = _ns()
        for inbox, chunk in zip(self.inboxes, chunks[1:], strict=True):
            inbox.put((chunk, grad))
        outputs = [self.module(chunks[0])]
        for outbox in self.outboxes:
            out = outbox.get()
            if isinstance(out, BaseException):
                raise out
            outputs.append(out)
        joined = _ns()
        result = torch.cat(outputs)
        end = _ns()
        self.before += handed - start
        self.split += split - start
        self.after += end - joined
        self.cat += end - joined
        self.whole += end - start
        return result


def _step(call: Callable[[torch.Tensor], torch.Tensor], mode: str, x: Any, y: Any, opt: Any) -> Any:
    if mode == "inference":

        def infer() -> None:
            with torch.no_grad():
                call(x)

        return infer

    def train() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(call(x), y).backward()
        opt.step()

    return train


def _block(fn: Callable[[], None], calls: int) -> None:
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(calls):
            fn()
    finally:
        if enabled:
            gc.enable()


def measure(model: str, mode: str, repeats: int = 7, calls: int | None = None) -> dict[str, Any]:
    """µs per call of each phase (medians over ``repeats`` blocks of ``calls`` calls), ours
    and the floor's, for two CPU replicas of ``model`` (``"mlp"``, ``"cnn"``) in ``mode``."""
    make, make_x, title = MODELS[model]
    torch.manual_seed(0)
    module = make()
    x = make_x()
    y = torch.randint(0, 10, (x.shape[0],))
    wrapped = DataParallel(module, ["cpu", "cpu"])
    floor = _TimedFloor(module, 2)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)
    if calls is None:
        calls = 200 if model == "mlp" else 30
    ours_fn, floor_fn = _step(wrapped, mode, x, y, opt), _step(floor, mode, x, y, opt)
    clock = _Clock()
    rows: dict[str, dict[str, list[float]]] = {}

    def add(side: str, key: str, ns: float) -> None:
        rows.setdefault(key, {}).setdefault(side, []).append(ns / calls / 1000)

    try:
        for _ in range(3):  # warm: plans kept, replicas built, workers started
            ours_fn()
            floor_fn()
        for _ in range(repeats):
            for phases, keys in (((_CALL, _HANDOFF), "totals"), ((_CALL, *PHASES), "phases")):
                with _patched(clock, phases):
                    clock.clear()
                    _block(ours_fn, calls)
                if keys == "totals":
                    add("ours", "serial Python before the hand-off", clock.before)
                    add("ours", "serial Python after the join", clock.after)
                    add("ours", "whole call", clock.total["call"])
                else:
                    for label, _, _ in PHASES:
                        add("ours", label, clock.total.get(label, 0))
            floor.before = floor.after = floor.split = floor.cat = floor.whole = 0
            _block(floor_fn, calls)
            add("floor", "whole call", floor.whole)
            add("floor", "serial Python before the hand-off", floor.before)
            add("floor", "serial Python after the join", floor.after)
            add("floor", "scatter", floor.split)
            add("floor", "gather", floor.cat)
    finally:
        floor.close()
    table = {
        key: {side: statistics.median(values) for side, values in sides.items()}
        for key, sides in rows.items()
    }
    return {"model": model, "label": title, "mode": mode, "calls": calls, "us": table}


def _ratio(table: dict[str, dict[str, float]], key: str) -> float | None:
    sides = table.get(key, {})
    if "ours" not in sides or not sides.get("floor"):
        return None
    return sides["ours"] / sides["floor"]


def case_phases(settings: Settings) -> list[Case]:
    """Per model and mode: the serial Python before the hand-off against the floor's (target
    ``SERIAL_TARGET``), and after the join (for information); the whole table in ``extra``."""
    repeats = max(3, min(settings.repeats, 9))
    cases: list[Case] = []
    for model in MODELS:
        for mode in ("inference", "training"):
            found = measure(model, mode, repeats)
            table = found["us"]
            for key, short, target in (
                ("serial Python before the hand-off", "before_handoff", SERIAL_TARGET),
                ("serial Python after the join", "after_join", None),
            ):
                sides = table[key]
                stats = {side: Stats.of([sides[side] / 1e6], found["calls"]) for side in sides}
                cases.append(
                    Case(
                        f"phases_{model}_{mode}_{short}",
                        f"{key}, two CPU replicas, {found['label']}, {mode}: ours against the "
                        "hand-written floor's (µs per call, timed inside real calls)",
                        "floor",
                        "ours",
                        stats,
                        _ratio(table, key),
                        _ratio(table, key),
                        "our µs / the floor's µs",
                        "<=",
                        target,
                        extra={"phases_us": table},
                    )
                )
    return cases


def format_phases(found: dict[str, Any]) -> str:
    """The table of one ``measure`` result, ours beside the floor's."""
    lines = [f"{found['label']}, {found['mode']}, two CPU replicas (µs per call, medians)"]
    lines.append(f"  {'phase':<36}{'ours':>9}{'floor':>9}")
    for key, sides in found["us"].items():
        ours, floor = sides.get("ours"), sides.get("floor")
        cells = [f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in (ours, floor)]
        lines.append(f"  {key:<36}{''.join(cells)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.phases [--repeats N]``: print the tables (one torch thread)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.phases", description=__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="timed blocks per phase")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in MODELS:
            for mode in ("inference", "training"):
                print(format_phases(measure(model, mode, args.repeats)), flush=True)
    finally:
        torch.set_num_threads(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
