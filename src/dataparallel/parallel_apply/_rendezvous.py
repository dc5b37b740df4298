"""The rendezvous where the replicas of one call meet at each ``nn.SyncBatchNorm`` layer.

A :class:`SyncCall` is made per call by :mod:`dataparallel.parallel_apply._syncbn` (which finds
the layers) and run by the pool (which marks it ``concurrent``). Here the replicas of one call
are threads of one process, so the layers meet without a process group:

- each replica's forward runs under a ``TorchFunctionMode`` of its own (thread-local, entered on
  the replica's thread) that intercepts the ``F.batch_norm`` call made by
  ``nn.SyncBatchNorm.forward`` (found by its code object on the stack, so plain ``BatchNorm*``
  layers, and any other caller, keep torch's per-chunk behaviour) and nothing else;
- the replica computes its chunk's per-channel mean and biased variance (float32 at least) and
  count, and hands them to the slot; the last replica to arrive combines them on the first
  replica's device with differentiable ops (the parallel-variance formula), and each replica
  normalises its chunk with the whole batch's mean and variance, moved to its device. The
  combine is ordinary autograd graph shared by the replicas' outputs, so backward (run by
  autograd's engine, never by the pool) needs no barrier and gives one device's gradients;
- the running statistics are written once, by replica 0 (the module itself, or the replica
  whose buffers the wrapper copies back), from the whole batch's mean and unbiased variance;
  ``num_batches_tracked`` is counted once because only replica 0's count is kept.

Nothing can hang: a replica that finishes its forward without reaching a layer the others
reach leaves the slot (the layer's statistics are then those of the replicas that reached it),
a replica that fails releases the others with ``ReplicaFailed`` (the caller re-raises the
original error), replicas that reach the layers in different orders (each waiting for another)
fail at once, and a wait longer than ``WAIT_SECONDS`` is an error. Layers are told apart by
their place in the replica's tree: a ``SyncBatchNorm`` reached some other way (a plain
attribute shared by the replicas, a nested wrapper's own replicas) keeps torch's per-chunk
behaviour. The rendezvous is used
only when the pool runs the replicas at once (``concurrent``): replicas run one after another
(under a ``torch.func`` transform or a dispatch mode, or nested in a replica) normalise each
chunk on its own, with a warning.

Under ``torch.use_deterministic_algorithms(True)`` replicas that share a random generator must
not draw from it at once (the draws would land in a racing order). There the call is
``ordered``: the replicas run on the pool but take turns, in replica order, handing the turn on
at each layer (once they have handed in their statistics) and when they finish. Only one runs
at any moment, so every draw happens in the same order on every run, and the layers still see
the whole batch: same seed, same result, and one device's statistics.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dataparallel._common.warn import warn_user
from dataparallel.parallel_apply._checkpointed import checkpointed, in_checkpoint

__all__ = ["WAIT_SECONDS", "LayerTable", "ReplicaFailed", "SyncCall"]

# How long a replica waits for the others at one layer before the call fails. The wait is the
# time between the fastest and the slowest replica reaching that layer: seconds at most, unless
# a replica is stuck.
WAIT_SECONDS = 300.0

_BATCH_NORM = F.batch_norm
_SYNC_FORWARD = nn.SyncBatchNorm.forward.__code__
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ReplicaFailed(RuntimeError):
    """Raised in a replica waiting at a SyncBatchNorm layer when another replica failed: the
    caller reports the other replica's own error first."""


class LayerTable(Protocol):
    """What a rendezvous reads of its replica set's layers (``_syncbn.SyncLayers``, which makes
    calls: a protocol, so that this module does not import that one back).

    Attributes:
        index: per replica, layer object id to the layer's index in preorder.
        names: each layer's qualified name, by that index (for messages).
        warned: whether the per-chunk fallback was warned about already (once per table).
    """

    index: list[dict[int, int]]
    names: list[str]
    warned: bool


class _Slot:
    """One use of one layer in one call: each replica's (mean, var, count, ready event), then
    the result and its ready event (CUDA events; ``None`` elsewhere)."""

    __slots__ = ("eps", "parts", "ready", "result")

    def __init__(self, n: int, eps: float) -> None:
        self.eps = eps
        self.parts: list[tuple[torch.Tensor, torch.Tensor, int, Any] | None] = [None] * n
        self.result: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self.ready: Any = None


def _record(tensor: torch.Tensor) -> Any:
    """A CUDA event recorded on this thread's current stream of ``tensor``'s device (replicas
    on one GPU run on side streams: the reader waits for it), else ``None``."""
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def _wait(event: Any, *devices: torch.device) -> None:
    """Make this thread's current streams of ``devices`` wait for ``event`` (if any)."""
    if event is not None:
        for device in devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).wait_event(event)


class SyncCall:
    """The rendezvous of one call's replicas (see the module docstring).

    ``concurrent`` is set by the runner when, and only when, the replicas run at once on the
    pool; otherwise every replica runs its SyncBatchNorm layers per chunk (with a warning), so
    a runner that goes one replica after another can never wait on itself.
    """

    def __init__(self, table: LayerTable, devices: list[torch.device]) -> None:
        self.table = table
        self.devices = devices
        self.n = len(devices)
        self.concurrent = False
        # Set with ``concurrent`` under deterministic algorithms: the replicas take turns
        # (``turn`` is the one running), so draws from a shared generator keep one order.
        self.ordered = False
        self.turn = 0
        self.why = ""  # set by the runner when the replicas ran one after another
        self.timeout = WAIT_SECONDS
        self.cond = threading.Condition(threading.Lock())
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.left: set[int] = set()
        self.waiting: dict[int, tuple[int, int]] = {}  # replica -> the slot it waits at
        # (replica, "Type: message") of the first failure: a string, not the exception, so
        # that no traceback (whose frames hold this object) makes a reference cycle.
        self.failure: tuple[int, str] | None = None

    def bind(self, modules: Sequence[Any]) -> list[Callable[..., Any]]:
        """One callable per replica that runs it inside its rendezvous context."""
        return [_Bound(self, j, m) for j, m in enumerate(modules)]

    # -- the runner's side ----------------------------------------------------------------

    def run(self, j: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.concurrent:
            if j == 0:
                self._warn_sequential()
            return module(*args, **kwargs)
        try:
            if self.ordered:
                self._take_turn(j, None)
            with _Mode(self, j):
                result = module(*args, **kwargs)
        except BaseException as exc:
            self.leave(j, exc)
            raise
        self.leave(j, None)
        return result

    def leave(self, j: int, error: BaseException | None) -> None:
        """Replica ``j`` finished (``error`` when it failed): slots it never reached complete
        without it, or, after a failure, release their waiters with ``ReplicaFailed``."""
        with self.cond:
            self.left.add(j)
            if error is not None and self.failure is None and not isinstance(error, ReplicaFailed):
                self.failure = (j, _describe(error))
            if self.failure is None:
                for slot in self.slots.values():
                    self._complete(slot)
            if self.ordered and self.turn == j:
                self._pass_turn(j)
            self.cond.notify_all()

    def abort(self, error: BaseException) -> None:
        """The runner was interrupted: release every waiting replica."""
        with self.cond:
            if self.failure is None:
                self.failure = (-1, _describe(error))
            self.cond.notify_all()

    def _warn_sequential(self) -> None:
        if self.table.warned:
            return
        self.table.warned = True
        why = f" (under {self.why})" if self.why else ""
        warn_user(
            f"SyncBatchNorm layers ({', '.join(self.table.names[:3])}"
            f"{', ...' if len(self.table.names) > 3 else ''}) normalised each chunk with its "
            f"own statistics in this call: the replicas ran one after another{why}, so they "
            f"cannot meet; run the call outside that state, or on one device, for whole-batch "
            f"statistics"
        )

    # -- the layer's side -------------------------------------------------------------------

    def batch_norm(
        self,
        mode: _Mode,
        layer: nn.Module,
        input: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        training: bool = False,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> torch.Tensor:
        """``F.batch_norm`` for replica ``mode.index`` with the whole call's statistics."""
        j = mode.index
        k = self.table.index[j][id(layer)]  # the mode checked it is there
        use = mode.seen.get(k, 0)
        mode.seen[k] = use + 1
        x = input
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        count = x.numel() // channels
        xf = x.float() if x.dtype in _LOW_PRECISION else x
        if count:
            var_j, mean_j = torch.var_mean(xf, dim=dims, correction=0)
        else:  # an empty chunk: counts for nothing
            mean_j = var_j = xf.new_zeros(channels)
        mean, invstd, var, total = self._exchange(j, (k, use), mean_j, var_j, count, eps)
        if total == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size "
                f"{list(x.shape)} on this replica and 1 value per channel over the whole batch "
                f"(SyncBatchNorm normalises over every replica's chunk)"
            )
        if j == 0 and running_mean is not None and running_var is not None and total > 0:
            with torch.no_grad():  # once per call, as one device's F.batch_norm would
                unbiased = var * (total / (total - 1))
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var), alpha=momentum)
        # Few ops per replica (each is dispatch and an autograd node): y = x * scale + shift.
        scale = invstd if weight is None else invstd * weight
        shift = -(mean * scale) if bias is None else torch.addcmul(bias, mean, scale, value=-1)
        shape = [1, channels] + [1] * (x.dim() - 2)
        out = torch.addcmul(shift.view(shape), xf, scale.view(shape))
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _exchange(
        self,
        j: int,
        key: tuple[Any, int],
        mean: torch.Tensor,
        var: torch.Tensor,
        count: int,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Hand in replica ``j``'s statistics for ``key``; the whole call's mean, inverse
        standard deviation (both on ``mean``'s device) and biased variance (where combined),
        once every replica has handed in or left."""
        with self.cond:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot(self.n, eps)
            slot.parts[j] = (mean, var, count, _record(mean))
            self._complete(slot)
            self.cond.notify_all()
            deadline = time.monotonic() + self.timeout
            if slot.result is None:
                stuck = self._deadlocked(j)
                if stuck:
                    raise self._fail(
                        j,
                        RuntimeError(
                            f"SyncBatchNorm: replica {j} waits at layer {self._name(key)} while "
                            f"{stuck}: the replicas reached their SyncBatchNorm layers in "
                            f"different orders, so none can go on; every replica must run them "
                            f"in one order (a layer a replica skips is fine)"
                        ),
                    )
            self.waiting[j] = key
            try:
                if self.ordered:
                    self._pass_turn(j)  # handed in: the next replica's turn
                    self._take_turn(j, slot, key, deadline)
                else:
                    self._wait_for(j, key, slot, deadline)
            finally:
                del self.waiting[j]
            mean_all, invstd_all, var_all, total = slot.result  # type: ignore[misc]
            ready = slot.ready
        device = mean.device
        _wait(ready, device, mean_all.device)
        return mean_all.to(device), invstd_all.to(device), var_all, total

    def _wait_for(self, j: int, key: tuple[int, int], slot: _Slot, deadline: float) -> None:
        """Wait (under the lock) until the slot is complete, a replica failed, or the time is
        up."""
        while slot.result is None:
            if self.failure is not None:
                raise self._released(key)
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i, p in enumerate(slot.parts) if p is None and i not in self.left]
                raise self._fail(
                    j,
                    TimeoutError(
                        f"SyncBatchNorm layer {self._name(key)}: replica {j} waited "
                        f"{self.timeout:g} s for replicas {missing} to reach it; a replica is "
                        f"stuck, or the replicas ran one after another (run the call on one "
                        f"device, or convert the layer back to BatchNorm)"
                    ),
                )
            self.cond.wait(left)

    def _pass_turn(self, j: int) -> None:
        """Under the lock: the turn goes from replica ``j`` to the next replica still running,
        in replica order (round robin), and every waiter is woken to look."""
        for d in range(1, self.n + 1):
            i = (j + d) % self.n
            if i not in self.left:
                self.turn = i
                break
        self.cond.notify_all()

    def _take_turn(
        self,
        j: int,
        slot: _Slot | None,
        key: tuple[Any, int] = (-1, 0),
        deadline: float | None = None,
    ) -> None:
        """Wait until it is replica ``j``'s turn and, at a layer, its ``slot`` is complete
        (``ordered`` calls). Given the turn while its slot still waits for others, it hands
        the turn on. Released by a failure, or an error after the time is up."""
        if slot is None:
            self.cond.acquire()
        try:
            deadline = time.monotonic() + self.timeout if deadline is None else deadline
            while self.turn != j or (slot is not None and slot.result is None):
                if self.failure is not None:
                    raise self._released(key)
                if self.turn == j:  # our slot waits for a replica after us
                    self._pass_turn(j)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._fail(
                        j,
                        TimeoutError(
                            f"SyncBatchNorm: replica {j} waited {self.timeout:g} s for its turn"
                            + (f" at layer {self._name(key)}" if slot is not None else "")
                            + "; a replica is stuck (run the call on one device, or convert "
                            "the layer back to BatchNorm)"
                        ),
                    )
                self.cond.wait(left)
        finally:
            if slot is None:
                self.cond.release()

    def _fail(self, j: int, error: BaseException) -> BaseException:
        """Record replica ``j``'s ``error`` as the call's failure and wake every waiter (under
        the lock); the caller raises what it returns."""
        self.failure = (j, _describe(error))
        self.cond.notify_all()
        return error

    def _complete(self, slot: _Slot) -> None:
        """Combine the slot's statistics when every replica has handed in or left (under the
        lock; differentiable, on the first contributor's device)."""
        if slot.result is not None:
            return
        if any(p is None and i not in self.left for i, p in enumerate(slot.parts)):
            return
        parts = [p for p in slot.parts if p is not None]
        if not parts:  # pragma: no cover - a slot exists only once a replica handed in
            return
        full = [p for p in parts if p[2] > 0]
        total = sum(p[2] for p in full)
        if not full:
            slot.result = (parts[0][0], parts[0][1], parts[0][1], 0)
            return
        device = full[0][0].device
        for m, _, _, event in full:
            _wait(event, m.device, device)
        means = torch.stack([m.to(device) for m, _, _, _ in full])
        variances = torch.stack([v.to(device) for _, v, _, _ in full])
        weights = torch.tensor(
            [c / total for _, _, c, _ in full], dtype=means.dtype, device=device
        ).unsqueeze(1)
        mean = (means * weights).sum(0)
        var = ((variances + (means - mean).square()) * weights).sum(0)
        slot.result = (mean, torch.rsqrt(var + slot.eps), var, total)
        slot.ready = _record(mean)

    def _name(self, key: tuple[int, int]) -> str:
        k, use = key
        return repr(self.table.names[k]) + (f" (use {use + 1})" if use else "")

    def _deadlocked(self, j: int) -> str:
        """Under the lock, before replica ``j`` waits: when every other replica still running
        its forward is itself waiting at a layer not yet complete, nothing can ever arrive
        (the replicas reached the layers in different orders). Returns where each waits, else
        an empty string."""
        blocked = []
        for i in range(self.n):
            if i == j or i in self.left:
                continue
            other = self.waiting.get(i)
            if other is None or self.slots[other].result is not None:
                return ""  # replica i is running, or about to wake: it may still come
            blocked.append(f"replica {i} at {self._name(other)}")
        return ", ".join(blocked)

    def _released(self, key: tuple[Any, int]) -> ReplicaFailed:
        i, what = self.failure or (-1, "unknown")
        who = "the call was interrupted" if i < 0 else f"replica {i} failed"
        where = f"layer {self._name(key)}" if key[0] != -1 else "its turn to start"
        return ReplicaFailed(f"SyncBatchNorm {where}: stopped waiting because {who} ({what})")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


_RUN = SyncCall.run.__code__


class _Bound:
    """A replica run inside its call's rendezvous (what the pool calls)."""

    __slots__ = ("call", "index", "module")

    def __init__(self, call: SyncCall, index: int, module: Any) -> None:
        self.call, self.index, self.module = call, index, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call.run(self.index, self.module, args, kwargs)


def _calling_layer() -> nn.Module | None:
    """The ``nn.SyncBatchNorm`` whose ``forward`` made the ``F.batch_norm`` call being
    handled, else ``None`` (a plain BatchNorm, or any other caller)."""
    frame = sys._getframe(2)  # 0 this, 1 __torch_function__, 2 torch's handler or F.batch_norm
    for _ in range(6):
        if frame is None:
            return None
        if frame.f_code is _SYNC_FORWARD:
            layer = frame.f_locals.get("self")
            return layer if isinstance(layer, nn.SyncBatchNorm) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


class _Mode(TorchFunctionMode):
    """Entered on a replica's own thread for its forward: hands SyncBatchNorm's training-mode
    ``F.batch_norm`` to the rendezvous, and every other call straight through."""

    def __init__(self, call: SyncCall, index: int) -> None:
        super().__init__()
        self.call = call
        self.index = index
        self.seen: dict[Any, int] = {}  # uses of each layer so far in this replica's forward

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if func is _BATCH_NORM:
            layer = _calling_layer()
            # A layer outside the replica's tree (a shared attribute, a nested wrapper's own
            # replica) keeps torch's per-chunk behaviour: its peers cannot be told.
            if (
                layer is not None
                and layer.training
                and _training(args, kwargs)
                and id(layer) in self.call.table.index[self.index]
            ):
                if in_checkpoint(_RUN):
                    index = self.call.table.index[self.index][id(layer)]
                    raise RuntimeError(checkpointed(self.call.table.names[index]))
                return self.call.batch_norm(self, layer, *args, **kwargs)
        return func(*args, **kwargs)


def _training(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """The ``training`` argument of an ``F.batch_norm`` call (its sixth)."""
    if "training" in kwargs:
        return bool(kwargs["training"])
    return bool(args[5]) if len(args) > 5 else False
