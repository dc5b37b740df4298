"""One wave of a ``DataParallel`` call, step by step: its chunks, its replicas, their runs, and
the gather of every wave's outputs, each honouring the step a subclass overrides.

``DataParallel._pipeline`` calls these in order for each wave of the plan (one wave but under
``max_size``). They are functions of the wrapper rather than methods so that the class module
holds what a user reads and overrides (construction, ``forward``, torch's four steps), and the
wave mechanics live here; ``Wrapper`` names what they use of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import nn

from dataparallel._common.tree import leaves, map_leaves
from dataparallel._common.warn import warn_user
from dataparallel.gather import (
    Origins,
    Record,
    ScalarMode,
    first_batch_size,
    gather_outputs,
    unmark,
)
from dataparallel.parallel_apply import apply_replicas, as_arguments, sync_call
from dataparallel.plan import Plan
from dataparallel.replicate import CompiledReplicas, serial_mark
from dataparallel.scatter import take
from dataparallel.wrapper._placement import copy_writes_back, plain_attributes
from dataparallel.wrapper._results import DeviceOutputs, Load, record
from dataparallel.wrapper._steps import StepCall, step_rules

__all__ = [
    "Overrides",
    "Wrapper",
    "apply_wave",
    "gather_all",
    "one_chunk",
    "replicate_wave",
    "scatter_wave",
    "warn_unbatched",
]


class Overrides(NamedTuple):
    """Which of torch's overridable steps a ``DataParallel`` subclass replaces."""

    scatter: bool
    replicate: bool
    parallel_apply: bool
    gather: bool

    @classmethod
    def of(cls, subclass: type, base: type) -> Overrides:
        """The steps ``subclass`` overrides of ``base``'s (``DataParallel``'s).

        >>> from dataparallel import DataParallel
        >>> class Mine(DataParallel):
        ...     def gather(self, outputs, output_device):
        ...         return outputs
        >>> Overrides.of(Mine, DataParallel)
        Overrides(scatter=False, replicate=False, parallel_apply=False, gather=True)
        """
        return cls(*(getattr(subclass, n) is not getattr(base, n) for n in cls._fields))


class Wrapper(Protocol):
    """What the wave steps use of a ``DataParallel``: typed by its shape, so that this module,
    which the class imports, imports nothing of the class's."""

    dim: int
    scalars: ScalarMode
    gather_outputs: bool
    scalar_weights: Any
    output_device: torch.device
    src_device_obj: torch.device
    device_ids: list[torch.device]
    _modules: dict[str, nn.Module | None]
    __dict__: dict[str, Any]

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None, device_ids: Sequence[Any]
    ) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]: ...

    def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]: ...

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Sequence[Any]
    ) -> list[Any]: ...

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any: ...


def one_chunk(w: Wrapper, plan: Plan, steps: Overrides) -> Any:
    """A call planned as one chunk on the module's own device (every one-device call):
    ``_pipeline``'s steps for that case alone. The module is its own replica and runs on
    the caller's thread; nothing is replicated, the count (``num_items_in_batch``) is passed
    as it is, no weight is read."""
    device, start, length = plan.slices[0][0]
    args, kws = take(plan, start, length, device)
    module = cast(nn.Module, w._modules["module"])  # (past nn.Module.__getattr__)
    timers: list[Any] = []
    outputs = apply_replicas((module,), (args,), (kws,), (device,), timers)
    devices, sizes = [device], [length]
    record(w.__dict__, Load(devices, sizes, timers, 1))
    return gather_all(w, outputs, devices, sizes, None, steps)


def scatter_wave(
    w: Wrapper,
    plan: Plan,
    wave: list[tuple[torch.device, int, int]],
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    steps: Overrides,
) -> tuple[Sequence[Any], Sequence[Any], list[torch.device], list[int]]:
    """One wave's chunks, their devices and sizes: the plan's program run for each
    ``(device, start, length)`` of the wave, or the ``scatter`` override's chunks."""
    if not steps.scatter:
        chunk_args, chunk_kwargs, chunk_devices, chunk_sizes = [], [], [], []
        for device, start, length in wave:
            one_args, one_kwargs = take(plan, start, length, device)
            chunk_args.append(one_args)
            chunk_kwargs.append(one_kwargs)
            chunk_devices.append(device)
            chunk_sizes.append(length)
        return chunk_args, chunk_kwargs, chunk_devices, chunk_sizes
    devices = [device for device, _, _ in wave]
    if len(plan.slices) > 1:
        raise ValueError(
            "max_size: waves need the built-in scatter, but scatter is overridden; "
            "drop max_size or the override"
        )
    scattered, kws = w.scatter(inputs, kwargs, devices)
    args = as_arguments(scattered)  # a list per device is its arguments, as in torch
    # the override chose the chunks: read their sizes, pair devices as torch does
    sizes = [first_batch_size((a, k), w.dim) or 0 for a, k in zip(args, kws, strict=True)]
    return args, kws, devices[: len(args)], sizes


def replicate_wave(
    w: Wrapper, devices: list[torch.device], later: bool, steps: Overrides, waves: int = 1
) -> list[nn.Module]:
    """Replica 0 is the module itself: one chunk on its own device needs no replicate.

    Under ``max_size`` the module runs once per call, as on one device: in the first wave.
    Every later wave runs on copies only (the replicas after the module's own in a set with
    one more replica in front), so what a forward writes (``w.calls += 1``, BatchNorm's
    running statistics and ``num_batches_tracked``) lands once per call, from the first
    wave's replica 0; the copies' writes are dropped. Where the copies of one set run in
    several waves of a call (``waves``), each wave's are refilled from the module first, so no
    wave reads what another's copies wrote.
    """
    module = cast(nn.Module, w._modules["module"])  # (past nn.Module.__getattr__)
    sets = w.__dict__.get("_replica_sets")
    if len(devices) == 1 and devices[0] == w.src_device_obj and not later:
        return [module]
    if steps.replicate or "replicate" in w.__dict__:
        # An override (or patch_replication_callback's instance patch) may write the replicas
        # (Synchronized-BatchNorm's __data_parallel_replicate__ tags them as parallel): every
        # replica is then a copy, as torch's replica 0 is, and the module comes out untouched.
        w.__dict__["_copies_only"] = True
        if waves > 1 and sets is not None:  # (the set ``DataParallel.replicate`` then uses)
            sets.refill(module, [w.src_device_obj, *devices])
        try:
            return w.replicate(module, devices)
        finally:
            w.__dict__.pop("_copies_only", None)
    if later:
        key = [w.src_device_obj, *devices]
        if sets is not None:
            sets.refill(module, key)
        return w.replicate(module, key)[1:]
    return w.replicate(module, devices)


def apply_wave(
    w: Wrapper,
    replicas: list[nn.Module],
    args: Sequence[Any],
    kws: Sequence[Any],
    devices: list[torch.device],
    steps: Overrides,
    timers: list[Any],
    later: int,
    method: str | None = None,
) -> list[Any]:
    module = cast(nn.Module, w._modules["module"])  # (past nn.Module.__getattr__)
    alone = len(replicas) == 1 and replicas[0] is module
    options = w.__dict__.get("compile_options")  # (None in a wrapper from before)
    serial = serial_mark(replicas)  # replicate's mark, before compile= or a step wraps them
    # What an override's callbacks wrote on replica 0 is not the forward's: never written back
    own_replicate = steps.replicate or "replicate" in w.__dict__
    first = replicas[0]
    before = plain_attributes(first) if own_replicate and first is not module else None
    run = replicas if options is None else CompiledReplicas.of(w, options).wrap(replicas)
    if method is not None:  # train_step & co.: each replica runs its own method
        run = [StepCall(replica, method) for replica in replicas]
    sync = None if len(replicas) < 2 else sync_call(w.__dict__, replicas, devices)
    if steps.parallel_apply and not alone:
        # an override may call super().parallel_apply: it needs this wave's devices (and
        # the wave's SyncBatchNorm rendezvous)
        w.__dict__["_wave_devices"] = devices
        w.__dict__["_wave_sync"] = sync
        w.__dict__["_wave_serial"] = serial
        try:
            outputs = w.parallel_apply(run, args, kws)
        finally:
            w.__dict__.pop("_wave_devices", None)
            w.__dict__.pop("_wave_sync", None)
            w.__dict__.pop("_wave_serial", None)
        timers += [float("nan")] * len(devices)
    else:
        outputs = apply_replicas(run, args, kws, devices, timers, sync, serial)
    if replicas[0] is not module and not later:  # a later wave's writes are dropped
        copy_writes_back(replicas[0], module, before)
    return outputs


def gather_all(
    w: Wrapper,
    outputs: list[Any],
    devices: list[torch.device],
    sizes: list[int],
    weigh: Callable[[], list[float]] | None,
    steps: Overrides,
    method: str | None = None,
    origins: Origins | None = None,
    count: Record | None = None,
) -> Any:
    """The call's outputs gathered (or handed over, ``gather=False``, or to an overridden
    ``gather``). ``count``: the call's marks of ``num_items_in_batch``; the built-in gather
    sums what was computed from it, and re-forms the loss terms forward built (``gather._loss``);
    code of the user's receives plain values. ``weigh``: the ``scalar_weights``, read when a
    mean needs them."""
    user = not w.gather_outputs or steps.gather  # the user's code takes them, or one output
    if (user and len(outputs) > 1) or (count is not None and (user or len(outputs) == 1)):
        outputs = [map_leaves(unmark, out) for out in outputs]
    if not w.gather_outputs:
        return DeviceOutputs(outputs, devices, sizes)
    if steps.gather:
        return w.gather(outputs, w.output_device)
    module = cast(nn.Module, w._modules["module"])  # (past nn.Module.__getattr__, every call)
    return gather_outputs(
        outputs,
        w.output_device,
        w.dim,
        None if steps.scatter else sizes,  # an override chose the chunks: read them
        w.scalars,
        None,
        # (a wrapper unpickled from before has none)
        w.__dict__.get("output_rules")
        if method is None
        else step_rules(outputs[0], w.__dict__.get("output_rules")),
        module,
        origins,
        w.__dict__.get("_warned"),  # warnings shown once per wrapper
        count,
        weigh,
        said_of(w.__dict__),  # how each scalar was gathered, for explain
    )


def said_of(state: dict[str, Any]) -> dict[Any, str]:
    """The wrapper's record of how each scalar output was gathered (made at construction; a
    wrapper unpickled from an older version gets one here, once)."""
    said: dict[Any, str] | None = state.get("_said")
    if said is None:
        said = state["_said"] = {}
    return said


def warn_unbatched(w: Wrapper, plan: Plan, devices: int, inputs: Any, kwargs: Any) -> None:
    """A call on several devices that runs on one because none of its inputs is batched (PyG's
    whole ``Batch`` passed where a list of ``Data`` splits): said once per wrapper, naming
    ``explain`` and the ways to split. A batch of one sample (a vote for 1) is not warned."""
    if plan.votes or not plan.decided_by.startswith("default") or devices < 2:
        return
    warned = w.__dict__.setdefault("_warned", set())
    if ("unbatched",) in warned or not _holds_data((inputs, kwargs)):
        return  # (a call with no inputs, or only numbers and strings, has nothing to split)
    warned.add(("unbatched",))
    warn_user(
        f"DataParallel over {devices} devices: no input of this call has a batch dimension "
        f"along dim {w.dim} (w.explain(...) shows each input's rule), so the module ran once, "
        f"on {plan.slices[0][0][0]} alone. To split the batch, pass it as a tensor batched "
        f"along dim {w.dim} or as a list of per-sample items (PyG: a list of Data, with the "
        f"Batch built inside forward), or mark it dp.Split(x); to run on one device on "
        f"purpose, call w.module(...). Said once per wrapper"
    )


def _holds_data(tree: Any) -> bool:
    """Whether ``tree`` holds something that could have been a batch: a tensor or ndarray of
    one dimension or more, or an object (a PyG ``Batch``), not only numbers, strings, None."""
    for leaf in leaves(tree):
        if leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes)):
            continue
        if getattr(leaf, "ndim", 1) == 0:
            continue
        return True
    return False
