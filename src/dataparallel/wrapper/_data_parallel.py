"""``DataParallel``: the pipeline composed (``data_parallel``, its functional form, is in
``dataparallel.wrapper._functional``).

``DataParallel.forward`` reads as torch's: scatter, replicate, parallel_apply, gather, each an
overridable method with torch's signature, so subclasses written for
``torch.nn.DataParallel`` keep working. What differs is inside: the batch rules of
``dataparallel.plan``, cached replicas, a persistent worker pool, waves under ``max_size``, and
a gather that knows each replica's chunk size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.modules.module as _hooks
from torch import nn

from dataparallel._common.warn import warn_user
from dataparallel.devices import DeviceSpec, check_runnable, resolve_devices, target_device
from dataparallel.gather import (
    Origins,
    Record,
    ScalarWeights,
    check_output_rules,
    check_scalars,
    chunk_weights,
    gather,
    mark_inputs,
)
from dataparallel.parallel_apply import parallel_apply
from dataparallel.plan import Plan, build_plan
from dataparallel.replicate import (
    ReplicaSets,
    check_compile_option,
    check_not_compiled,
    warn_compiled_wrapper,
)
from dataparallel.scatter import take
from dataparallel.wrapper._check_option import check_option
from dataparallel.wrapper._explain import explain_call
from dataparallel.wrapper._options import (
    check_dim,
    check_module,
    check_plan_options,
    check_scalar_weights,
    plan_option,
)
from dataparallel.wrapper._partial_sums import (
    DEFAULT_SCALARS,
    find_count,
)
from dataparallel.wrapper._peft_class import class_for
from dataparallel.wrapper._placement import (
    check_module_device,
)
from dataparallel.wrapper._read_through import ModuleNames
from dataparallel.wrapper._results import CallStats, DeviceOutputs, LastCall, Load, record
from dataparallel.wrapper._runtime import CallState
from dataparallel.wrapper._saving import peft_load_state_dict, peft_state_dict
from dataparallel.wrapper._signature import PresentedForward, PresentedSignature
from dataparallel.wrapper._steps import StepMethod
from dataparallel.wrapper._warm import run_call, warm_call, warm_step
from dataparallel.wrapper._waves import (
    Overrides,
    apply_wave,
    gather_all,
    one_chunk,
    replicate_wave,
    scatter_wave,
    warn_unbatched,
)

__all__ = ["CallStats", "DataParallel", "DeviceOutputs"]


class DataParallel(ModuleNames, CallState, nn.DataParallel):
    """Run ``module`` over several devices on one batch, split by the batch rules.

    A drop-in for ``torch.nn.DataParallel``, and an instance of it (code that unwraps with
    ``isinstance(m, nn.DataParallel)`` finds ``.module``): same positional arguments,
    ``.module``, ``device_ids``, ``output_device``, ``dim``, state_dict keys ``module.*``,
    overridable ``scatter``, ``replicate``, ``parallel_apply`` and ``gather``. It also runs on
    CPU lists, splits per-sample lists, never drops samples, and reuses its replicas. The
    guide's "The wrapper" and "The batch rules, in short" say what each option does and why.

    Args:
        module: the module to run; its parameters and buffers must be on ``device_ids[0]``.
        device_ids (list[DeviceSpec] | DeviceSpec | None): device specs (``[0, 1]``, ``["cpu",
            "cpu"]``, ``[0, 0]``); ``None`` means every visible CUDA device, else the CPU.
        output_device (DeviceSpec | None): where the gathered output lands (``-1`` or
            ``"cpu"``: the CPU); default ``device_ids[0]``.
        dim: the batch dimension.
        batch_size, chunk_sizes, weights, max_size, dtype, strict: the batch options of
            ``dp.plan``; ``max_size`` runs a large batch in waves.
        scalars: how scalar outputs are gathered: ``"mean"`` (chunk-weighted), ``"sum"`` or
            ``"stack"``; outputs computed from a ``num_items_in_batch`` argument come back
            summed, as one device's (the guide's "The count, num_items_in_batch").
        gather: ``False`` returns the per-device outputs (``DeviceOutputs``) ungathered.
        scalar_weights: ``f(chunk_args, chunk_kwargs) -> number``, each chunk's weight in
            the ``"mean"`` of scalar outputs in place of its size, called only when a mean
            needs it; it replaces the loss terms' re-forming (the guide's "How a loss is
            gathered"). Ignored when ``gather`` is overridden.
        output_rules: ``{path: rule}`` for outputs whose shapes and values do not tell how to
            gather them, by the path gather's messages print: an int is the output's batch
            dimension (``{"output[1][0]": 1}`` for an LSTM's ``h_n`` beside its output),
            ``"sum"``, ``"mean"``, ``"stack"``, ``"all"`` or ``"any"`` (booleans), ``"same"``
            (one copy) or ``"list"`` (one per replica). Ignored when ``gather`` is overridden.
        compile: ``True``, or ``torch.compile``'s keyword arguments as a dict: each replica's
            forward is compiled once, the module's own included (the module is not changed).
            ``torch.compile(wrapper)`` compiles none of the model: use this.
        check: ``True`` compares calls with the same call on one device, on a copy of the
            module (outputs, then parameters and buffers, then gradients at backward) and
            warns ``dp.OneDeviceDifference`` per difference; ``"raise"`` raises it; ``None``
            reads ``DATAPARALLEL_CHECK`` (``1`` or ``raise``). Which calls: the first of each
            plan and after each rebuild, plus every ``check_every``-th (the guide's "Checking
            against one device").

    Attributes:
        module, device_ids, output_device, dim: torch's (the devices as ``torch.device``
            objects); setting one is checked as the constructor checks it.
        options (dict): the batch options by name, each also an attribute (``w.max_size = 4``,
            checked against the devices when set).
        scalars, scalar_weights, output_rules: as given; settable, read at every call.
        gather_outputs, compile_options: the ``gather`` and ``compile`` arguments.
        last_call (CallStats | None): the load of this thread's last call.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or an option has the wrong type.
        ValueError: a device spec, batch option, ``scalars`` or ``output_rules`` that cannot
            hold (a CUDA index not visible...), named with its fix. A call raises the batch
            rules' errors (``dp.plan``'s) and the module's own.

    Example:
        >>> import torch, dataparallel as dp
        >>> model = dp.DataParallel(torch.nn.Linear(5, 2), ["cpu", "cpu", "cpu"])
        >>> model(torch.randn(10, 5)).shape, model.last_call.chunk_sizes
        (torch.Size([10, 2]), [4, 3, 3])
    """

    # torch's meaning (the devices used, where the output lands), as ``torch.device`` objects:
    # a CPU list has no CUDA index to hold.
    device_ids: list[torch.device]  # type: ignore[assignment]
    output_device: torch.device  # type: ignore[assignment]

    # The batch options, read and set as attributes (``w.max_size = 4``), kept in ``options``.
    batch_size = plan_option("batch_size")
    chunk_sizes = plan_option("chunk_sizes")
    weights = plan_option("weights")
    max_size = plan_option("max_size")
    dtype = plan_option("dtype")
    strict = plan_option("strict")

    def __new__(cls, module: Any = None, *args: Any, **kwargs: Any) -> DataParallel:
        """A peft model's wrapper is an instance of its peft class too (``isinstance`` holds)."""
        return nn.Module.__new__(cls if module is None else class_for(cls, module))

    def __init__(
        self,
        module: nn.Module,
        device_ids: DeviceSpec | Sequence[DeviceSpec] | None = None,
        output_device: DeviceSpec | None = None,
        dim: int = 0,
        *,
        batch_size: int | None = None,
        chunk_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        max_size: int | None = None,
        dtype: torch.dtype | None = None,
        strict: bool = False,
        scalars: str = DEFAULT_SCALARS,
        gather: bool = True,
        scalar_weights: ScalarWeights | None = None,
        output_rules: Mapping[str, int | str] | None = None,
        compile: bool | Mapping[str, Any] = False,
        check: bool | str | None = None,
    ) -> None:
        """Check every argument now and wrap ``module`` (the class's Args; torch's are not run:
        they refuse CPU lists and repeated devices)."""
        # nn.Module's __init__, not torch's DataParallel's: its device checks refuse CPU lists
        nn.Module.__init__(self)
        self.module = check_module(module)
        self.device_ids = resolve_devices(device_ids)
        check_runnable(self.device_ids)
        self.output_device = (
            self.device_ids[0]
            if output_device is None
            else target_device(output_device, where="output_device")
        )
        check_runnable([self.output_device], where="output_device", indexed=False)
        self.src_device_obj = self.device_ids[0]
        check_not_compiled(module, self.device_ids)
        self.dim = check_dim(dim)
        self.options: dict[str, Any] = {
            "batch_size": batch_size,
            "chunk_sizes": chunk_sizes,
            "weights": weights,
            "max_size": max_size,
            "dtype": dtype,
            "strict": strict,
        }
        # Validate the options once, now, rather than at the first call.
        check_plan_options(self.device_ids, self.dim, self.options)
        self.scalars = check_scalars(scalars)
        self.gather_outputs = gather
        self.scalar_weights = check_scalar_weights(scalar_weights)
        self.output_rules = check_output_rules(output_rules)
        # torch.compile's keyword arguments, or None: the compiled replicas are made lazily
        self.compile_options = check_compile_option(compile)
        # check=: "warn", "raise" or None (``_one_device``); None reads DATAPARALLEL_CHECK
        self.check_mode = check_option(check)
        self.check_every = 0
        self._warned: set[tuple[str, ...]] = set()
        self._said: dict[Any, str] = {}  # how each scalar output was gathered (explain)
        self._find_overrides()  # from here on, assignments are checked (``__setattr__``)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """torch's (``module.*`` keys); a peft model's own keys at the top level, as it saves."""
        own = peft_state_dict(self, args, kwargs)
        return nn.DataParallel.state_dict(self, *args, **kwargs) if own is None else own

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """torch's; for a peft model, its own keys (``state_dict``'s) too."""
        done = peft_load_state_dict(self, state_dict, args, kwargs)
        return (
            nn.DataParallel.load_state_dict(self, state_dict, *args, **kwargs)
            if done is None
            else done
        )

    # The load of this thread's last call through this wrapper (``None`` before one).
    last_call = LastCall()

    # -- the pipeline -------------------------------------------------------------------------

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """``nn.Module.__call__``, with the common call (no hook on the wrapper, no global module
        hook, not traced by ``torch.jit.trace``, not compiled in place) sent straight to
        ``forward``, past the checks torch's ``Module._call_impl`` makes on every call (a few
        µs of Python on a warm call). Any other call is torch's own, so hooks, tracing and
        compilation behave exactly as torch's."""
        if (  # what _wrapped_call_impl and _call_impl read, in the same way
            self._compiled_call_impl is None
            and not (self._forward_hooks or self._forward_pre_hooks)
            and not (self._backward_hooks or self._backward_pre_hooks)
            and not (_hooks._global_forward_hooks or _hooks._global_forward_pre_hooks)
            and not (_hooks._global_backward_hooks or _hooks._global_backward_pre_hooks)
            and not _tracing()
        ):
            if self.__class__ is DataParallel:  # (a subclass may define its own forward)
                return _RUN(self, inputs, kwargs)
            return self.forward(*inputs, **kwargs)
        return nn.Module.__call__(self, *inputs, **kwargs)

    # inspect.signature(wrapper) and inspect.signature(wrapper.forward) name the module's
    # parameters, so signature-driven code (Trainer's column filter) sees the module's.
    __signature__ = PresentedSignature()

    @PresentedForward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Plan the call, then per wave scatter, replicate and apply; gather the outputs.

        One path for every call: on one device the plan has one chunk, reused from the last
        call while the arguments' signature holds, its scatter moves nothing, and the module is
        its own replica, run on the caller's thread. Introspection sees the module's signature
        (``inspect.signature(w.forward)``).

        Calls through one wrapper run one at a time (a training thread and an evaluation
        thread sharing it take turns): its replicas are one set of objects, re-synced for each
        call. Gradients are unaffected: a call never writes a tensor an earlier call's graph
        saved. Threads that must run at once use a wrapper each (they share the module).
        A pool worker never waits for the lock (``wait_for``): that could wait on its caller.
        Returns the gathered output, or ``DeviceOutputs`` with ``gather=False``.
        """
        return _RUN(self, inputs, kwargs)

    # mmcv's and mmengine's step methods, where the module has them (dataparallel.wrapper._steps)
    train_step = StepMethod()
    val_step = StepMethod()
    test_step = StepMethod()

    def _run_step(self, name: str, *inputs: Any, **kwargs: Any) -> Any:
        """``forward``'s pipeline with each replica running its method ``name``."""
        with self._call_lock():
            check_module_device(self.__dict__, self.module, self.src_device_obj)
            return self._pipeline(inputs, kwargs, name)

    def _eager_forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``forward`` reached through ``torch.compile(wrapper)``: run as without it."""
        warn_compiled_wrapper(self)
        return self.forward(*inputs, **kwargs)

    def _pipeline(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        method: str | None = None,
        found: Plan | None = None,
    ) -> Any:
        """The call from the plan on; ``found``: its plan, where ``_warm.run_call`` found it and
        its warm step could not serve it."""
        state = self.__dict__
        steps: Overrides = state.get("_steps") or self._find_overrides()
        module: nn.Module = self._modules["module"]  # type: ignore[assignment]
        if found is None:
            found = (state.get("_plans") or self._plan_cache()).find(
                inputs, kwargs, self.device_ids, self.dim, self.options
            )
            if found.warnings:
                self._warn_once(found)
            warm = warm_step(self, found, steps, module, inputs, kwargs) if method is None else None
            if warm is not None:  # a kept plan's call, which a loop repeats: one cached step
                return warm_call(self, warm, found, module, inputs, kwargs, steps)
        plan = found if found.memo is None else found.bind(inputs, kwargs)
        slices = plan.slices
        if len(slices) == 1 and len(slices[0]) == 1 and len(self.device_ids) > 1:
            warn_unbatched(self, plan, len(self.device_ids), inputs, kwargs)  # nothing split
        if (
            len(slices) == 1
            and len(slices[0]) == 1
            and slices[0][0][0] == self.src_device_obj
            and method is None
            and not steps.scatter
            and self.scalar_weights is None
            and self.__dict__.get("compile_options") is None
        ):
            return one_chunk(self, plan, steps)
        outputs: list[Any] = []
        devices: list[torch.device] = []
        sizes: list[int] = []
        timers: list[Any] = []  # floats, or CUDA spans read only when asked
        # num_items_in_batch: each replica receives the whole count, marked (_partial_sums)
        slot = None if method is not None else find_count(module, inputs, kwargs)
        count = None if slot is None else Record()
        # A loss's terms are observed (gather._loss) on several chunks, unless weighed or
        # compiled (dynamo traces plain tensors)
        marks = self.scalar_weights is None and method is None and len(plan.slices[0]) > 1
        marks = marks and self.__dict__.get("compile_options") is None
        # What each output's replica received, for gather to tell a buffer or input passed
        # through from a value computed per chunk (read only when a scalar needs it).
        chunk_args: list[Any] = []
        chunk_kws: list[Any] = []
        chunk_replicas: list[nn.Module] = []
        # The later waves run first, then the first: every later wave's copies are made from
        # the state the call began with, as one device reads it for every sample, before the
        # first wave's replica 0 (the module) writes its counters, buffers and teachers.
        waves = len(plan.slices)
        ran: dict[int, tuple[Any, ...]] = {}
        for later in [*range(1, waves), 0]:
            args, kws, wave_devices, wave_sizes = scatter_wave(
                self, plan, plan.slices[later], inputs, kwargs, steps
            )
            if marks or count is not None:
                args, kws = mark_inputs(args, kws, marks, count, slot)
            replicas = replicate_wave(self, wave_devices, bool(later), steps, waves)
            wave_timers: list[Any] = []
            wave_outputs = apply_wave(
                self, replicas, args, kws, wave_devices, steps, wave_timers, later, method
            )
            ran[later] = (wave_outputs, wave_devices, wave_sizes, wave_timers, args, kws, replicas)
        for later in range(waves):  # in the batch's order
            wave_outputs, wave_devices, wave_sizes, wave_timers, args, kws, replicas = ran[later]
            outputs += wave_outputs
            devices += wave_devices
            sizes += wave_sizes
            timers += wave_timers
            chunk_args += args
            chunk_kws += kws
            chunk_replicas += replicas
        record(self.__dict__, Load(devices, sizes, timers, len(plan.slices)))
        origins = (
            Origins(
                chunk_replicas,
                None if steps.scatter else plan.program,
                chunk_args,
                chunk_kws,
            )
            if len(outputs) > 1
            else None
        )
        weigh = None
        if self.scalar_weights is not None:  # read only when a mean needs them
            fn, chunks = self.scalar_weights, (chunk_args, chunk_kws)
            weigh = lambda: chunk_weights(fn, *chunks)  # noqa: E731
        return gather_all(self, outputs, devices, sizes, weigh, steps, method, origins, count)

    # -- the steps, each honouring its override -------------------------------------------------

    def _find_overrides(self) -> Overrides:
        """Which of torch's four steps this wrapper's class overrides: decided once, at
        construction (or at the first call of a wrapper unpickled from an older version)."""
        steps = self.__dict__["_steps"] = Overrides.of(type(self), DataParallel)
        return steps

    # -- torch's overridable steps ----------------------------------------------------------

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None, device_ids: Sequence[Any]
    ) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
        """torch's signature: per-device argument tuples and kwargs dicts for one round."""
        plan = build_plan(
            inputs,
            kwargs,
            resolve_devices(device_ids),
            self.dim,
            allow_waves=False,
            **self.options,
        )
        self._warn_once(plan)
        chunks = [take(plan, s, n, d) for d, s, n in plan.slices[0]]
        return tuple(a for a, _ in chunks), tuple(k for _, k in chunks)

    def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> list[nn.Module]:
        """Replicas of ``module`` on ``device_ids``, kept by this wrapper between calls."""
        sets: ReplicaSets | None = self.__dict__.get("_replica_sets")
        if sets is None:  # made lazily: a copied or unpickled wrapper has none
            sets = self.__dict__["_replica_sets"] = ReplicaSets()
        if self.__dict__.get("_copies_only"):  # an override may write them: copies, as torch's
            return sets.replicate(module, [self.src_device_obj, *device_ids])[1:]
        return sets.replicate(module, list(device_ids))

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Sequence[Any]
    ) -> list[Any]:
        """torch's signature: run each replica on its inputs, on the pool's threads."""
        devices = self.__dict__.get("_wave_devices") or self.device_ids[: len(replicas)]
        sync = self.__dict__.get("_wave_sync")
        serial = self.__dict__.get("_wave_serial")
        return parallel_apply(replicas, inputs, kwargs, devices, syncbn=sync, serial=serial)

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        """torch's signature: one output on ``output_device``, chunk sizes inferred."""
        return gather(outputs, output_device, self.dim, scalars=self.scalars, module=self.module)

    def explain(self, *inputs: Any, **kwargs: Any) -> Plan:
        """The plan this wrapper would follow for a call ``w(*inputs, **kwargs)``; runs nothing.
        Its notes say how the call's outputs will be gathered where that is not the default
        (``num_items_in_batch``), how the calls so far gathered each scalar output (a loss
        re-formed term by term, a mean weighed by chunk size, ...), which BatchNorm layers of
        the module are synchronised over the replicas, and, under ``check=``, that the call is
        compared with one device's. Only such a call (and the step methods) is split: a method
        of the module called through the wrapper (``w.generate(...)``, read-through) runs the
        module itself, on its own device, as ``w.module.generate(...)`` does."""
        module = cast(nn.Module, self._modules["module"])
        weighted = self.scalar_weights is not None  # (they replace the terms' re-forming)
        state = self.__dict__  # the check mode, and how the calls so far gathered each scalar
        check, said = state.get("check_mode"), state.get("_said")
        args = (module, inputs, kwargs, self.device_ids, self.dim, self.options)
        return explain_call(*args, weighted=weighted, check=check, said=said)

    # -- checks -----------------------------------------------------------------------------------

    def _warn_once(self, plan: Plan) -> None:
        if plan.warnings and plan.warning_key not in self._warned:
            self._warned.add(plan.warning_key)
            for message in plan.warnings:
                warn_user(message)


_RUN = run_call  # forward's body (``_warm``), where a subclass cannot shadow it
_tracing = torch._C._get_tracing_state
