"""The CPU benchmark cases, each measured against its baseline in the same run.

Every function takes the harness ``Settings`` and returns its ``Case`` list; none of them
needs a GPU. ``QUICK`` is what ``dataparallel bench`` runs; ``FULL`` adds the end-to-end
``DataParallel`` cases of ``e2e.py`` (1 to 8 replicas against a hand-written floor) and the peers
that need extra software or processes (mmcv 1.x, the DDP path of ``bench_ddp.py``, and
``dataparallel train --strategy ddp`` itself against a raw DDP loop, ``bench_train_ddp.py``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_syncbn import case_syncbn
from benchmarks.check_scaling import case_check_scaling, many_module_net
from benchmarks.e2e import case_e2e
from benchmarks.harness import Case, Settings, Stats, compare, paired_ratio
from benchmarks.phases import case_phases
from dataparallel.app.demo.models import Net
from dataparallel.devices import resolve_devices
from dataparallel.gather import gather
from dataparallel.markers import Shared
from dataparallel.plan import build_plan, plan
from dataparallel.replicate import clear_replica_cache, fresh_replicate, replicate
from dataparallel.scatter import scatter
from dataparallel.scatter._plans import PlanCache
from dataparallel.wrapper import DataParallel

__all__ = [
    "FULL",
    "QUICK",
    "case_compile",
    "case_ddp",
    "case_mmcv_scatter",
    "case_plan_cache",
    "case_plan_scaling",
    "case_replicate",
    "case_scatter_gather",
    "case_train_ddp",
    "case_train_step",
    "heterogeneous_batch",
    "many_module_net",
]

CaseFn = Callable[[Settings], list[Case]]
CPU2 = ["cpu", "cpu"]
BENCH_DIR = Path(__file__).resolve().parent
DDP_TIMEOUT_S = 150


def _pair(
    name: str,
    title: str,
    stats: dict[str, Stats],
    measured: str,
    baseline: str,
    *,
    op: str = "<=",
    target: float | list[float] | None,
    what: str,
    extra: dict[str, Any] | None = None,
) -> Case:
    ratio, of_medians = paired_ratio(stats[measured], stats[baseline])
    return Case(
        name,
        title,
        baseline,
        measured,
        stats,
        ratio,
        of_medians,
        what,
        op,
        target,
        extra=extra or {},
    )


# -- a. scatter + gather of a heterogeneous batch -------------------------------------------


def heterogeneous_batch(batch: int = 256) -> tuple[Any, ...]:
    """Images, per-sample boxes of varying counts, per-sample names, a shared table, a dict."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, 32, 32, generator=g)
    counts = torch.randint(1, 21, (batch,), generator=g).tolist()  # never the chunk size
    boxes = [torch.rand(k, 4, generator=g) for k in counts]
    names = [f"sample-{i:05d}.png" for i in range(batch)]
    table = torch.randn(1, 64, generator=g)
    targets = {
        "labels": torch.randint(0, 10, (batch,), generator=g),
        "weights": torch.rand(batch, generator=g),
    }
    return images, boxes, names, Shared(table), targets


def _bounds(batch: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(batch, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append((start, start + size))
        start += size
    return out


def _by_hand(inputs: tuple[Any, ...], devices: list[str]) -> tuple[Any, ...]:
    """The floor: the same cuts, moves and concatenations written out for this one batch.

    A tensor already on its device is not moved (``.to`` would return it unchanged, after a
    call the library does not make either): on CPU devices nothing moves at all.
    """
    images, boxes, names, shared, targets = inputs
    table = shared.obj
    bounds = _bounds(images.shape[0], len(devices))
    sizes = [e - s for s, e in bounds]
    image_parts = torch.split(images, sizes)
    label_parts = torch.split(targets["labels"], sizes)
    weight_parts = torch.split(targets["weights"], sizes)
    here = images.device
    chunks = []
    for d, ((s, e), name) in enumerate(zip(bounds, devices, strict=True)):
        device = torch.device(name)
        if device.type == here.type and (device.index or 0) == (here.index or 0):
            chunks.append(
                (
                    image_parts[d],
                    boxes[s:e],
                    names[s:e],
                    table,
                    {"labels": label_parts[d], "weights": weight_parts[d]},
                )
            )
            continue
        chunks.append(
            (
                image_parts[d].to(device),
                [b.to(device) for b in boxes[s:e]],
                names[s:e],
                table.to(device),
                {"labels": label_parts[d].to(device), "weights": weight_parts[d].to(device)},
            )
        )
    return (
        torch.cat([c[0] for c in chunks]),
        [b for c in chunks for b in c[1]],
        [n for c in chunks for n in c[2]],
        chunks[0][3],
        {
            "labels": torch.cat([c[4]["labels"] for c in chunks]),
            "weights": torch.cat([c[4]["weights"] for c in chunks]),
        },
    )


def _ours(inputs: tuple[Any, ...], devices: list[str]) -> Any:
    return gather(scatter(inputs, devices), "cpu")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def case_scatter_gather(settings: Settings) -> list[Case]:
    """(a) ``scatter`` then ``gather`` of a heterogeneous batch against the hand-written floor."""
    inputs = heterogeneous_batch()
    if not _same(_ours(inputs, CPU2), _by_hand(inputs, CPU2)):
        raise RuntimeError("scatter+gather and the hand-written floor disagree")
    stats = compare(
        {"dataparallel": lambda: _ours(inputs, CPU2), "by hand": lambda: _by_hand(inputs, CPU2)},
        settings,
    )
    return [
        _pair(
            "scatter_gather_hetero",
            "scatter+gather, B=256 (images, 256 boxes, 256 names, Shared table, dict) "
            "on 2 CPU devices vs torch.split/cat/slicing by hand",
            stats,
            "dataparallel",
            "by hand",
            target=2.0,
            what="time / hand-written floor",
        )
    ]


def case_mmcv_scatter(settings: Settings) -> list[Case]:
    """mmcv 1.x's scatter of the same batch, as a peer, where mmcv 1.x is installed."""
    title = "mmcv 1.x scatter_kwargs of the same batch (CPU) vs dataparallel scatter"
    try:
        import mmcv
        from mmcv.parallel import scatter_kwargs
    except Exception as exc:
        return [
            Case(
                "mmcv_scatter_peer",
                title,
                skipped=f"mmcv 1.x not importable ({type(exc).__name__}: {exc}); PyPI has no "
                "wheel of mmcv 1.7.2, only a source distribution whose build fails here "
                "(its setup.py imports pkg_resources)",
            )
        ]
    if not str(mmcv.__version__).startswith("1."):
        return [Case("mmcv_scatter_peer", title, skipped=f"mmcv {mmcv.__version__} is not 1.x")]
    inputs = heterogeneous_batch()
    plain = (inputs[0], inputs[1], inputs[2], inputs[3].obj, inputs[4])
    stats = compare(
        {
            "mmcv": lambda: scatter_kwargs(plain, {}, [-1]),  # -1: mmcv's CPU "device"
            "dataparallel": lambda: scatter(inputs, ["cpu"]),
        },
        settings,
    )
    return [
        _pair(
            "mmcv_scatter_peer",
            title,
            stats,
            "mmcv",
            "dataparallel",
            target=None,
            what="mmcv time / dataparallel time (one CPU device, mmcv's CPU mode)",
        )
    ]


# -- b. plan cost as leaves grow ------------------------------------------------------------

LEAF_COUNTS = (1, 10, 100, 1000, 10000)


def case_plan_scaling(settings: Settings) -> list[Case]:
    """(b) ``dp.plan`` on a dict of 1..10,000 tensors: time per leaf, and linearity."""
    batches = {n: {f"x{i}": torch.zeros(4, 2) for i in range(n)} for n in LEAF_COUNTS}

    def planner(batch: dict[str, torch.Tensor]) -> Callable[[], object]:
        return lambda: plan((batch,), None, CPU2)

    stats = compare({f"{n} leaves": planner(batches[n]) for n in LEAF_COUNTS}, settings)
    per_leaf = {str(n): stats[f"{n} leaves"].median / n for n in LEAF_COUNTS}
    # Least-squares slope of log(time) on log(leaves) over 100..10,000: 1 is linear.
    xs = [math.log(n) for n in LEAF_COUNTS if n >= 100]
    ys = [math.log(stats[f"{n} leaves"].median) for n in LEAF_COUNTS if n >= 100]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    case = _pair(
        "plan_scaling",
        "dp.plan of a dict of N tensors on 2 CPU devices: time(10,000) / time(1,000)",
        stats,
        "10000 leaves",
        "1000 leaves",
        op="in",
        target=[7.5, 12.5],
        what="time(10,000 leaves) / time(1,000 leaves); linear is 10",
        extra={"seconds_per_leaf": per_leaf, "loglog_slope_100_to_10000": slope},
    )
    return [case]


def case_plan_cache(settings: Settings) -> list[Case]:
    """(b2) A wrapper's plan, from its cache: a dict of 100 tensors and two plain tensors on 2
    CPU devices, against building the plan afresh (what every call of containers cost before
    containers were cached)."""
    devices = resolve_devices(CPU2)
    options = DataParallel(nn.Identity(), CPU2).options
    batch = {f"x{i}": torch.zeros(8, 4) for i in range(100)}
    x = torch.zeros(8, 4)
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
        "dict of 100": ((batch,), {}),
        "2 tensors": ((x, x), {}),
    }
    fns: dict[str, Callable[[], object]] = {}
    for label, (args, kwargs) in calls.items():
        cache = PlanCache()
        cache.get(args, kwargs, devices, 0, options)  # kept: every timed call is a hit
        fns[f"cached, {label}"] = partial(cache.get, args, kwargs, devices, 0, options)
        fns[f"fresh, {label}"] = partial(build_plan, args, kwargs, devices, 0, **options)
    stats = compare(fns, settings)
    return [
        _pair(
            f"plan_cached_{tag}",
            f"the plan of a call of {label} on 2 CPU devices, from the wrapper's cache / built",
            stats,
            f"cached, {label}",
            f"fresh, {label}",
            target=target,
            what="cached plan time / fresh plan time",
            extra={"cached_us": stats[f"cached, {label}"].median * 1e6, "target_us": limit},
        )
        for tag, label, target, limit in (
            ("dict100", "dict of 100", 0.1, 30.0),
            ("tensors", "2 tensors", None, None),
        )
    ]


# -- c. DataParallel on one CPU replica, training step --------------------------------------


def case_train_step(settings: Settings) -> list[Case]:
    """(c) One SGD step of the tutorial CNN at batch 32: ``DataParallel(net, ["cpu"])`` vs net."""
    torch.manual_seed(0)
    plain = Net(3, 32, 10)
    wrapped = DataParallel(copy.deepcopy(plain), ["cpu"])
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))

    def stepper(model: nn.Module) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return step

    stats = compare({"DataParallel": stepper(wrapped), "plain": stepper(plain)}, settings)
    return [
        _pair(
            "dp_one_replica_train_step",
            "training step (fwd, loss, bwd, SGD) of Net(3, 32, 10), batch 32: "
            "DataParallel(net, ['cpu']) vs the plain module",
            stats,
            "DataParallel",
            "plain",
            target=1.03,
            what="step time / plain step time",
        )
    ]


# -- c2. compile=: compiled replicas against eager ones ---------------------------------------


def case_compile(settings: Settings, options: bool | dict[str, Any] = True) -> list[Case]:
    """(c2) One SGD step of the tutorial CNN at batch 64 on two CPU replicas:
    ``DataParallel(net, CPU2, compile=True)`` (inductor) against eager replicas. Reported for
    information (no target): on a CPU, inductor's gain depends on the machine, and its first
    call compiles (seconds to minutes), done before timing. ``options`` is ``compile=``
    (the tests pass the "eager" backend, which compiles in a second)."""
    title = (
        "training step (fwd, loss, bwd, SGD) of Net(3, 32, 10), batch 64, on ['cpu', 'cpu']: "
        "DataParallel(compile=True) vs eager replicas"
    )
    torch.manual_seed(0)
    x = torch.randn(64, 3, 32, 32)
    y = torch.randint(0, 10, (64,))

    def stepper(compile_: bool | dict[str, Any]) -> Callable[[], None]:
        torch.manual_seed(0)
        net = Net(3, 32, 10)
        model = DataParallel(net, CPU2, compile=compile_)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return step

    compiled = stepper(options)
    try:
        compiled()  # the compile itself, before the harness calibrates on it
    except Exception as exc:  # no C compiler, or a platform inductor does not support
        return [Case("dp_compile_train_step", title, skipped=f"inductor failed: {exc!r:.200}")]
    stats = compare({"compiled": compiled, "eager": stepper(False)}, settings)
    return [
        _pair(
            "dp_compile_train_step",
            title,
            stats,
            "compiled",
            "eager",
            target=None,
            what="compiled step time / eager step time",
        )
    ]


# -- d. cached replicate against fresh replicas ---------------------------------------------


class _Counting(nn.Module):
    """A module outside the replicated tree that counts steps, as metrics modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0


def case_replicate(settings: Settings) -> list[Case]:
    """(d) ``replicate`` (cached) vs ``fresh_replicate``, 2 and 4 CPU replicas.

    Three modes: inference; training on ``"cpu"`` replicas (they share the module's
    parameters, so this is the inference path plus autograd); and training on ``"cpu:1"``,
    ``"cpu:2"``, ... (the tests' second CPU device), which takes the differentiable-copy path
    that replicas on another GPU take. Then, in inference on 2 replicas: every call after a
    write to a module outside the tree (another model's step counter: the check must not see
    it), and every call after a write to one module inside it (that module's replicas are
    refilled). Then the cost of a cache miss: ``replicate`` right after ``clear_replica_cache``
    (a build plus the checks that decide to cache it) against ``fresh_replicate``.
    """
    net = many_module_net()
    modules = sum(1 for _ in net.modules())
    cases = []
    for count in (2, 4):
        same = ["cpu"] * count
        spread = ["cpu", *(f"cpu:{i}" for i in range(1, count))]
        for mode, grad, devices in (
            ("inference", False, same),
            ("training", True, same),
            ("training_copy", True, spread),
        ):
            net.train(grad)

            def cached(d: list[str] = devices, g: bool = grad) -> object:
                with torch.set_grad_enabled(g):
                    return replicate(net, d)

            def fresh(d: list[str] = devices, g: bool = grad) -> object:
                with torch.set_grad_enabled(g):
                    return fresh_replicate(net, d)

            stats = compare({"cached": cached, "fresh": fresh}, settings)
            cases.append(
                _pair(
                    f"replicate_{count}x_{mode}",
                    f"replicate of a {modules}-module net onto {devices}, {mode} "
                    f"({'grad enabled' if grad else 'torch.no_grad'}): cached vs fresh",
                    stats,
                    "cached",
                    "fresh",
                    # issue 20's goal for a cache hit: a twentieth of a fresh build
                    target=None if mode == "training_copy" else 0.05,
                    what="cached time / fresh_replicate time",
                    extra={"modules": modules, "replicas": count, "devices": devices},
                )
            )
    net.eval()
    devices = ["cpu", "cpu"]
    neighbour = _Counting()
    inside = net.get_submodule("25.2")  # a ReLU in the middle of the tree

    def after_neighbour_write() -> object:
        neighbour.total += 1
        with torch.no_grad():
            return replicate(net, devices)

    def after_inside_write() -> object:
        setattr(inside, "calls", getattr(inside, "calls", 0) + 1)  # noqa: B010
        with torch.no_grad():
            return replicate(net, devices)

    def fresh_nograd() -> object:
        with torch.no_grad():
            return fresh_replicate(net, devices)

    for name, fn, title, target in (
        (
            "replicate_2x_neighbour_writes",
            after_neighbour_write,
            "each call after a write to a module outside the tree",
            0.05,
        ),
        (
            "replicate_2x_one_module_written",
            after_inside_write,
            "each call after a write to one of its modules (its replicas refilled)",
            None,
        ),
    ):
        stats = compare({"cached": fn, "fresh": fresh_nograd}, settings)
        cases.append(
            _pair(
                name,
                f"replicate of a {modules}-module net onto {devices}, inference, {title}: "
                "cached vs fresh",
                stats,
                "cached",
                "fresh",
                target=target,
                what="cached time / fresh_replicate time",
                extra={"modules": modules, "replicas": 2, "devices": devices},
            )
        )

    def miss() -> object:
        clear_replica_cache(net)
        with torch.no_grad():
            return replicate(net, devices)

    def fresh2() -> object:
        with torch.no_grad():
            return fresh_replicate(net, devices)

    stats = compare({"miss": miss, "fresh": fresh2}, settings)
    cases.append(
        _pair(
            "replicate_2x_miss",
            f"replicate of a {modules}-module net onto 2 CPU replicas after "
            "clear_replica_cache (a cache miss) vs fresh_replicate",
            stats,
            "miss",
            "fresh",
            target=None,
            what="cache-miss time / fresh_replicate time",
            extra={"modules": modules, "replicas": 2},
        )
    )
    return cases


# -- e. the DDP path (bench_ddp.py, another author's script) --------------------------------


def case_ddp(settings: Settings) -> list[Case]:
    """(e) ``benchmarks/bench_ddp.py`` as a subprocess: our DDP path vs a plain DDP loop."""
    title = (
        "DDP training path, 2 gloo processes, samples/s: ours vs plain torch DDP "
        "(stats: seconds per 1,000 samples)"
    )
    script = BENCH_DIR / "bench_ddp.py"
    if not script.exists():
        return [Case("ddp_path", title, skipped="benchmarks/bench_ddp.py does not exist yet")]
    repeats = max(2, min(settings.repeats, 5))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        cmd = [sys.executable, str(script), "--out", str(out), "--repeats", str(repeats)]
        # A session of its own, so that a hang (a rendezvous that never completes) can be
        # ended with every process it spawned.
        proc = subprocess.Popen(
            cmd,
            cwd=BENCH_DIR.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=DDP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return [
                Case(
                    "ddp_path",
                    title,
                    skipped=f"bench_ddp.py --repeats {repeats} ran past {DDP_TIMEOUT_S} s "
                    "and was stopped (its processes hang or are too slow here)",
                )
            ]
        if proc.returncode != 0 or not out.exists():
            tail = " ".join((output or "").split()[-40:])
            return [
                Case("ddp_path", title, skipped=f"bench_ddp.py exited {proc.returncode}: {tail}")
            ]
        report = json.loads(out.read_text())
    try:
        rates = {w: [r["samples_per_s"] for r in runs] for w, runs in report["runs"].items()}
        medians = report["samples_per_s_median"]
        # paired per repeat: each repeat ran both ways back to back
        ratio = statistics.median(o / p for o, p in zip(rates["ours"], rates["plain"], strict=True))
        target = float(report.get("target_ratio", 0.97))
    except (KeyError, TypeError, ValueError) as exc:
        return [Case("ddp_path", title, skipped=f"bench_ddp.py's JSON lacks {exc!r}")]
    # The harness reports seconds; here a "sample" is one epoch's seconds per 1,000 samples.
    stats = {w: Stats.of([1000 / r for r in rs], 1) for w, rs in rates.items()}
    return [
        Case(
            "ddp_path",
            title,
            "plain",
            "ours",
            stats,
            ratio,
            medians["ours"] / medians["plain"],
            "samples/s of ours / samples/s of plain DDP",
            ">=",
            target,
            extra={"bench_ddp": report},
        )
    ]


# -- f. the product's own DDP path: `dataparallel train --strategy ddp` vs raw DDP -----------


def case_train_ddp(settings: Settings) -> list[Case]:
    """(f) ``bench_train_ddp.py``: the CLI's ddp training against a raw torch DDP loop."""
    from benchmarks.bench_train_ddp import TARGET, run_rounds

    title = (
        "`dataparallel train --strategy ddp --nproc-per-node 2` against a raw torch DDP loop "
        "under torchrun, random data, 100 epochs, samples/s (stats: seconds per 1,000 samples)"
    )
    rounds = max(3, min(settings.repeats, 5))
    try:
        report = run_rounds(rounds, epochs=100, echo=False)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return [Case("train_ddp", title, skipped=" ".join(str(exc).split())[-400:])]
    rates = {w: [r["samples_per_s"] for r in runs] for w, runs in report["runs"].items()}
    stats = {w: Stats.of([1000 / r for r in rs], 1) for w, rs in rates.items()}
    return [
        Case(
            "train_ddp",
            title,
            "raw",
            "ours",
            stats,
            report["ratio"],
            report["ratio_of_medians"],
            "samples/s of ours / samples/s of the raw DDP loop",
            ">=",
            TARGET,
            extra={"train_ddp": report},
        )
    ]


QUICK: tuple[CaseFn, ...] = (
    case_scatter_gather,
    case_plan_scaling,
    case_plan_cache,
    case_train_step,
    case_replicate,
    case_syncbn,
)
FULL: tuple[CaseFn, ...] = (
    *QUICK,
    case_compile,
    case_e2e,
    case_phases,
    case_check_scaling,
    case_mmcv_scatter,
    case_ddp,
    case_train_ddp,
)
