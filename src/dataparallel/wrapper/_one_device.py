"""``check=``: a call through the wrapper compared with the same call on one device.

A checked call deep-copies the module first, runs the data-parallel call, then the same call on
the copy, on ``device_ids[0]``, from the same random state (and puts the stream back where the
data-parallel call left it). It compares the outputs at once, the module's parameters,
buffers and plain attributes with the copy's after the call (what forward wrote:
``_state_diff``), and, when the user's backward
reaches an output, that output's contribution to each parameter's gradient with the copy's
driven by the same output gradient (``torch.autograd.grad`` from a hook on the gathered
output: ``.grad`` and the optimizer never see it). Each difference beyond ``RTOL`` of the
magnitude is a :class:`OneDeviceDifference`, warned once per place or raised.

Calls between a checked call and the first backward through its outputs run on the copy too
(a *session*), so "two forwards, then one backward" is compared as one device runs it. Which
calls open a session: the first of each call signature and training mode, the first after the
replicas were rebuilt, and every ``check_every``-th call when that is set. Off (``check=None``
with no ``DATAPARALLEL_CHECK`` in the environment, or ``check=False``), nothing of this runs:
``forward`` reads one attribute.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dataparallel._common.tree import flatten, map_tensors
from dataparallel._common.warn import warn_user
from dataparallel.wrapper._check_option import OneDeviceDifference
from dataparallel.wrapper._results import DeviceOutputs
from dataparallel.wrapper._state_diff import state_differences

__all__ = ["RTOL", "checked_call"]

# Relative to the larger magnitude of the two (at least ``_FLOOR``): summation order alone moves
# a float32 result by a few units in the 7th digit; a half-precision one in the 3rd.
RTOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2}
_RTOL_DEFAULT = 1e-4
# Gradients pass back through every layer: a deep stack of BatchNorm layers over small maps
# moves a float32 gradient by a few 1e-4 on summation order alone (princeton-vl's hourglass).
_GRAD_SLACK = 10.0
_FLOOR = 1e-3

# A session that no backward closes (an evaluation loop with grad enabled) ends after this many
# calls: its graphs are let go.
_SESSION_CALLS = 8


class _Session:
    """The copy of the module one checked call made, kept in step with the module by the calls
    that follow it until a backward reaches one of their outputs."""

    def __init__(self, copy_: nn.Module) -> None:
        self.copy = copy_
        self.calls = 0
        self.open = True
        # Per hooked output: [data-parallel output, copy's output], emptied when the hook has
        # run or the session is let go (the hook's closure must not keep a graph alive).
        self.holders: list[list[torch.Tensor]] = []

    def close(self) -> None:
        self.open = False

    def release(self) -> None:
        self.open = False
        for holder in self.holders:
            holder.clear()
        self.holders.clear()


class _State:
    """One wrapper's check: what it has seen and reported, and its open session."""

    def __init__(self) -> None:
        self.seen: set[Any] = set()
        self.stamp: Any = None
        self.recheck = False
        self.calls = 0
        self.reported: set[str] = set()
        self.off: str | None = None  # why nothing is checked any more
        self.session: _Session | None = None


def checked_call(w: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``w._pipeline(inputs, kwargs)``, compared with one device's where this call is due."""
    state: _State | None = w.__dict__.get("_one_device")
    if state is None:
        state = w.__dict__["_one_device"] = _State()
    module: nn.Module = w._modules["module"]
    if state.off is not None:
        return w._pipeline(inputs, kwargs)
    session = state.session if state.session is not None and state.session.open else None
    state.calls += 1
    key = _signature(inputs, kwargs, module.training)
    every = w.__dict__.get("check_every", 0)
    due = key not in state.seen or state.recheck or (every and state.calls % every == 0)
    if session is None and not due:
        out = w._pipeline(inputs, kwargs)
        _watch_replicas(w, state)
        return out
    if session is None:
        if state.session is not None:
            state.session.release()
        try:
            session = state.session = _Session(copy.deepcopy(module))
        except Exception as error:  # a module deepcopy refuses: nothing is checked
            _give_up(
                w, state, f"the module cannot be deep-copied ({type(error).__name__}: {error})"
            )
            return w._pipeline(inputs, kwargs)
    before = _rng_state()
    out = w._pipeline(inputs, kwargs)
    state.seen.add(key)
    state.recheck = False
    _watch_replicas(w, state)
    after = _rng_state()
    _set_rng(before)
    try:
        device = w.src_device_obj
        args, kws = map_tensors((inputs, kwargs), lambda t: _to(t, device))
        ref = session.copy(*args, **kws)
    except Exception as error:  # a forward that runs only once, or only through the wrapper
        _give_up(w, state, f"the same call on a copy raised {type(error).__name__}: {error}")
        return out
    finally:
        _set_rng(after)
    session.calls += 1
    try:
        _compare(w, state, session, out, ref)
    except OneDeviceDifference:
        raise
    except Exception as error:  # outputs the comparison cannot read: say so, never break a call
        _give_up(w, state, f"comparing the outputs raised {type(error).__name__}: {error}")
    if not session.holders or session.calls >= _SESSION_CALLS:
        session.close()
    return out


def _give_up(w: Any, state: _State, why: str) -> None:
    state.off = why
    if state.session is not None:
        state.session.release()
        state.session = None
    warn_user(
        f"check=: {why:.300}; nothing is checked for this wrapper (the one-device comparison "
        f"needs a copy of the module that runs the call as the module would)"
    )


def _signature(inputs: tuple[Any, ...], kwargs: dict[str, Any], training: bool) -> Any:
    """What tells one call's plan from another's: each leaf's shape, dtype and device, or type."""
    try:
        leaves, _ = flatten((inputs, kwargs))
    except ValueError:  # nested too deep for a walk: one signature for all such calls
        return training, None
    return training, tuple(
        (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else type(x)
        for x in leaves
    )


def _watch_replicas(w: Any, state: _State) -> None:
    """A rebuilt replica set (new objects) makes the next call a checked one."""
    sets = w.__dict__.get("_replica_sets")
    stamp = None if sets is None else tuple(map(id, getattr(sets, "sets", {}).values()))
    if stamp != state.stamp:
        state.recheck = state.stamp is not None
        state.stamp = stamp


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else torch.Tensor.to(t, device)


# -- the comparisons ------------------------------------------------------------------------------


def _compare(w: Any, state: _State, session: _Session, out: Any, ref: Any) -> None:
    module: nn.Module = w._modules["module"]
    # (per-device outputs, gather=False or a gather override's: no one output to compare)
    if w.__dict__.get("gather_outputs", True) and not isinstance(out, DeviceOutputs):
        got_paths: list[str] = []
        got, _ = flatten(out, paths=got_paths, root="output")
        want_paths: list[str] = []
        want, _ = flatten(ref, paths=want_paths, root="output")
        ours = dict(zip(got_paths, got, strict=True))
        theirs = dict(zip(want_paths, want, strict=True))
        only_there = [p for p in want_paths if p not in ours]
        only_here = [p for p in got_paths if p not in theirs]
        # An object gather cannot put together (a cache, a record) comes back one per replica,
        # the gather rules' documented "list": not a difference of values.
        opaque = [p for p in only_there if not isinstance(theirs[p], _VALUES)]
        only_here = [p for p in only_here if not any(p.startswith(f"{q}[") for q in opaque)]
        if only_here or len(opaque) < len(only_there):
            _report(
                w,
                state,
                "output",
                f"output: other values than one device returns (only here: {only_here[:4]}; "
                f"only there: {only_there[:4]}); no rule of the library covers it",
            )
        for path, a in ours.items():
            if path in theirs:
                _compare_output(w, state, path, a, theirs[path])
                _hook(w, state, session, path, a, theirs[path])
    mine = dict(_tensors(module))
    for name, copied in _tensors(session.copy):
        held = mine.get(name)
        if held is not None:
            what = "parameter" if isinstance(copied, nn.Parameter) else "buffer"
            size = _difference(held, copied)
            if size is not None:
                _report(
                    w,
                    state,
                    f"{what} {name}",
                    f"{what} {name} after the call: {size}{_why(what, module)}",
                )
    for place, words in state_differences(module, session.copy):
        _report(w, state, place, f"{place} after the call: {words}{_why('attribute')}")


_VALUES = (torch.Tensor, int, float, complex, str, bytes, type(None))


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(module.named_parameters(), module.named_buffers())


def _compare_output(w: Any, state: _State, path: str, a: Any, b: Any) -> None:
    if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            last = w.last_call
            batch = None if last is None else sum(last.chunk_sizes)
            why = _shape_why(path, a, b, batch)
            shapes = f"shape {tuple(a.shape)} where one device returns {tuple(b.shape)}"
            _report(w, state, path, f"{path}: {shapes}{why}")
            return
        size = _difference(a, b)
        if size is not None:
            why = _why("scalar" if b.dim() == 0 else "output", w._modules["module"])
            _report(w, state, path, f"{path}: {size}{why.replace('<path>', path)}")
    elif isinstance(b, float) and isinstance(a, (int, float)):
        size = _difference(torch.tensor(float(a)), torch.tensor(b))
        if size is not None:
            _report(w, state, path, f"{path}: {size}{_why('scalar').replace('<path>', path)}")


def _difference(
    a: torch.Tensor, b: torch.Tensor, floor: float = _FLOOR, slack: float = 1.0
) -> str | None:
    """``None`` when ``a`` is ``b`` within the tolerance (times ``slack``), else the difference
    in words. ``floor``: the smallest magnitude the tolerance is relative to."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} where one device has {tuple(b.shape)}"
    if not (b.is_floating_point() or b.is_complex()):
        same = torch.equal(a.detach().cpu(), b.detach().cpu())
        return None if same else "differs (exact values)"
    if b.numel() == 0:
        return None
    x, y = a.detach().double().cpu(), b.detach().double().cpu()
    scale = max(x.abs().max().item(), y.abs().max().item(), floor)
    diff = (x - y).abs().nan_to_num(nan=float("inf")).max().item()
    if diff <= RTOL.get(b.dtype, _RTOL_DEFAULT) * slack * scale:
        return None
    return f"differs by {diff / scale:.3g} of its magnitude ({scale:.3g})"


def _shape_why(path: str, a: torch.Tensor, b: torch.Tensor, batch: int | None) -> str:
    if sorted(a.shape) == sorted(b.shape) and b.dim() > 1:
        dims = [d for d in range(b.dim()) if b.shape[d] == batch and a.shape[d] != batch]
        dim = str(dims[0]) if dims else "<its batch dim>"
        return (
            f": gather read another dimension as the batch; name the output's batch dimension "
            f"with output_rules={{{path!r}: {dim}}} (or take the per-device outputs with "
            f"gather=False)"
        )
    return "; no rule of the library covers it (output_rules= names how an output is gathered)"


_WHY = {
    "output": (
        "; forward computes something over the whole batch (a statistic such as x.var(0), a "
        "similarity matrix of the batch with itself), which each replica computes over its own "
        "chunk: no rule of the library covers it; compute it outside the wrapper, or run the "
        "module on one device"
    ),
    "scalar": (
        "; a scalar computed per chunk is gathered as the chunk-weighted mean (scalars='mean'): "
        "if it is a sum, pass scalars='sum' or output_rules={'<path>': 'sum'}; if its mean is "
        "over something else than the samples, scalar_weights=; else no rule covers it"
    ),
    "buffer": (
        "; forward wrote it from each replica's chunk rather than from the whole batch (replica "
        "0's write is kept, as torch's): no rule of the library covers it"
    ),
    "parameter": (
        "; forward wrote the parameter (in place or through .data) from its chunk: no rule of "
        "the library covers it"
    ),
    "attribute": (
        "; forward wrote it from replica 0's chunk (replica 0's write of the module's own "
        "state lands once per call), or once per replica where the replicas share it (a list, "
        "a dict, a numpy array): compute it from the wrapper's output after the call, or keep "
        "it in a tensor buffer, whose write one replica alone makes lands too"
    ),
    "grad": (
        "; with the outputs the same, the backward differs: a tensor that forward wrote (in "
        "place or through .data) and an earlier call's backward reads, or a hook: no rule of "
        "the library covers it"
    ),
}


def _why(what: str, module: nn.Module | None = None) -> str:
    """The rule or option that explains a difference of kind ``what``, or the words that say
    none covers it. The module's layers name the usual causes first."""
    if module is None or what in ("grad", "scalar", "attribute"):
        return _WHY[what]
    hints = _layer_hints(module)
    return "; " + "; ".join(hints) if hints else _WHY[what]


def _layer_hints(module: nn.Module) -> list[str]:
    hints = []
    layers = [m for m in module.modules() if m.training]
    if any(isinstance(m, _BN) and not isinstance(m, nn.SyncBatchNorm) for m in layers):
        hints.append(
            "plain BatchNorm in training normalises each replica's chunk with its own "
            "statistics (and updates the running ones from replica 0's): convert it with "
            "nn.SyncBatchNorm.convert_sync_batchnorm(model) for the whole batch's"
        )
    drop = any(isinstance(m, _DROP) and getattr(m, "p", 0) > 0 for m in layers)
    if drop and not torch.are_deterministic_algorithms_enabled():
        hints.append(
            "dropout's draws: replicas that share a random generator (a CPU list, one GPU) draw "
            "in one device's order only under torch.use_deterministic_algorithms(True)"
        )
    return hints


_BN = nn.modules.batchnorm._BatchNorm
_DROP = nn.modules.dropout._DropoutNd


def _report(w: Any, state: _State, place: str, message: str) -> None:
    """Once per place: warned, or raised under ``check="raise"``."""
    if place in state.reported:
        return
    state.reported.add(place)
    text = f"check=: differs from one device: {message}"
    if w.__dict__.get("check_mode") == "raise":
        raise OneDeviceDifference(text)
    warn_user(text, OneDeviceDifference)


# -- gradients ----------------------------------------------------------------------------------


def _hook(w: Any, state: _State, session: _Session, path: str, a: Any, b: Any) -> None:
    """At the user's backward through output ``a``: its contribution to each parameter's
    gradient, against the copy's output ``b`` driven by the same gradient."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return
    if a.grad_fn is None or b.grad_fn is None or a.shape != b.shape:
        return
    holder = [a, b]
    version = a._version
    session.holders.append(holder)

    def compare_grads(grad: torch.Tensor) -> None:
        if not holder:  # run, let go, or our own autograd.grad below passing through here
            return
        ours, theirs = holder
        holder.clear()
        session.close()  # the calls after this backward are not the copy's to follow
        if ours._version != version or state.off is not None:  # (in place since: another graph)
            return
        try:
            _compare_grads(w, state, session, path, ours, theirs, grad)
        except OneDeviceDifference:
            raise
        except Exception as error:  # a graph autograd.grad cannot walk again: say so, once
            _give_up(w, state, f"comparing the gradients raised {type(error).__name__}: {error}")

    a.register_hook(compare_grads)


def _compare_grads(
    w: Any,
    state: _State,
    session: _Session,
    path: str,
    ours: torch.Tensor,
    theirs: torch.Tensor,
    grad: torch.Tensor,
) -> None:
    """Output ``path``'s contribution to each parameter's gradient, ours and the copy's."""
    mine = [(n, p) for n, p in w._modules["module"].named_parameters() if p.requires_grad]
    copied = dict(session.copy.named_parameters())
    pairs = [(n, p, copied[n]) for n, p in mine if n in copied]
    if not pairs:
        return
    with torch.enable_grad():
        got = torch.autograd.grad(
            ours, [p for _, p, _ in pairs], grad, retain_graph=True, allow_unused=True
        )
        want = torch.autograd.grad(
            theirs,
            [q for _, _, q in pairs],
            torch.Tensor.to(grad, theirs.device),
            retain_graph=True,
            allow_unused=True,
        )
    # A gradient summed from large terms may cancel to near zero (a bias before BatchNorm):
    # each is compared relative to the largest gradient of this output's contribution too.
    floor = max(
        [_FLOOR, *(h.detach().abs().max().item() for h in want if h is not None and h.numel())]
    )
    for (name, p, _), g, h in zip(pairs, got, want, strict=True):
        g = torch.zeros_like(p) if g is None else g
        h = torch.zeros_like(p) if h is None else h
        size = _difference(g, h, floor, _GRAD_SLACK)
        if size is not None:
            place = f"grad of {name}"
            why = f"; it follows from {path}'s difference" if path in state.reported else ""
            text = f"{place} (through {path}): {size}{why or _why('grad')}"
            _report(w, state, place, text)
