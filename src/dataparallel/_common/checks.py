"""Guards: the checks that turn a bad input into one clear error, kept apart from the rules.

Each function here either returns quietly or raises (or warns) with the argument path, what
was found, what was expected and the fix, so that no bad input reaches torch or Python's own
machinery and surfaces as a raw traceback. ``plan``, ``gather`` and ``replicate`` call them on
the rare paths only (a non-dict Mapping, a non-strided tensor, a failed concatenation, a cache
miss), so the hot path pays nothing for them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from dataparallel._common.describe import describe
from dataparallel._common.rebuild import rebuild_mapping
from dataparallel._common.tree import MAX_DEPTH

__all__ = [
    "check_batch_size_used",
    "check_chunk_sizes_of",
    "check_gather_sizes",
    "check_initialized",
    "check_layout",
    "check_mapping",
    "check_scalar_weights",
    "concat_error",
    "dim_out_of_range",
    "replicate_scripted",
    "too_deep",
]

# ---------------------------------------------------------------------------- the batch rules


def too_deep(obj: Any, path: str, ancestors: list[int]) -> None:
    """Refuse a container that contains itself, or nesting deeper than ``MAX_DEPTH``."""
    if id(obj) in ancestors:
        raise ValueError(
            f"{path}: a {type(obj).__name__} that contains itself (a cycle), expected a tree of "
            f"containers; pass a copy without the back-reference (dp.Shared does not help: "
            f"its tensors are moved to each device by the same walk)"
        )
    raise ValueError(
        f"{path[:60]}...: containers nested more than {MAX_DEPTH} levels deep, expected at "
        f"most {MAX_DEPTH}; flatten the input (dp.Shared does not help: its tensors are moved "
        f"to each device by the same walk)"
    )


def check_layout(x: torch.Tensor, path: str) -> None:
    """Sparse COO tensors are split (``narrow_copy``); nested and other layouts are refused."""
    if x.is_nested:
        raise TypeError(
            f"{path}: a nested tensor, expected a regular (strided) tensor: its samples have no "
            f"common shape to cut; pass list(x.unbind()) to split it per sample, or "
            f"dp.Shared(x) to broadcast it"
        )
    if x.layout is not torch.sparse_coo:
        raise TypeError(
            f"{path}: a tensor of layout {x.layout}, expected a strided or sparse COO tensor; "
            f"pass x.to_dense() or x.to_sparse() (COO), or dp.Shared(x) to broadcast it"
        )


def check_mapping(obj: Any, path: str, keys: list[Any], values: list[Any]) -> None:
    """A Mapping that is not a dict must be rebuildable, or each chunk would fail later."""
    try:
        rebuild_mapping(obj, dict(zip(keys, values, strict=True)))
    except TypeError as exc:
        raise TypeError(f"{path}: {exc}") from exc


def dim_out_of_range(dim: int, ndim: int) -> ValueError:
    """``dim`` that no input has: without this, nothing votes and the batch would be 1."""
    return ValueError(
        f"dim: {dim} is out of range for every input (the most dimensions is {ndim}), "
        f"expected a dim in [{-ndim}, {ndim - 1}]; pass the batch dimension of your inputs "
        f"(usually dim=0)"
    )


def check_batch_size_used(batch: int, entries: list[tuple[str, str, str, Any]]) -> None:
    """``batch_size=N`` that no input has would copy every input whole to every device."""
    if any(rule != "broadcast" for _, rule, _, _ in entries):
        return
    found = ", ".join(f"{path} is {describe(value)}" for path, _, _, value in entries[:4])
    raise ValueError(
        f"batch_size: {batch}, but no input has {batch} samples ({found}), so every device "
        f"would get a copy of the whole batch; expected the size of a batched input: pass that "
        f"size, or drop batch_size= to let the inputs vote (on a DataParallel, "
        f"w.batch_size = N sets this option: a value of your own belongs on the module, "
        f"w.module.batch_size)"
    )


# ---------------------------------------------------------------------------- the gather rules


def _shapes(values: list[Any], sizes: Sequence[int] | None) -> str:
    return ", ".join(
        f"replica {i} has shape {tuple(v.shape)}"
        + ("" if sizes is None else f" for a chunk of {sizes[i]}")
        for i, v in enumerate(values)
    )


def concat_error(
    values: list[Any], where: str, dim: int, sizes: Sequence[int] | None
) -> ValueError:
    """The error for tensors that cannot be concatenated: every replica's shape, as
    accelerate lists every process's; where they differ along one other dimension only, the
    usual cause (a sequence padded to its own chunk's longest) and its fix."""
    return ValueError(
        f"{where}: cannot concatenate the replicas' outputs along dim {dim}: "
        f"{_shapes(values, sizes)}; expected the same shape on every replica except along dim "
        f"{dim}. {_padded_hint(values, dim)}Return the same shape from every replica, say "
        f"where its batch is with output_rules={{{where!r}: dim}}, or use gather=False to "
        f"handle the per-replica outputs yourself"
    )


def _padded_hint(values: list[Any], dim: int) -> str:
    """What to say when the shapes differ along one dimension other than ``dim``: each chunk
    padded its sequences to its own longest (``pad_packed_sequence`` without
    ``total_length``)."""
    shapes = [tuple(getattr(v, "shape", ())) for v in values]
    ndim = len(shapes[0])
    if ndim < 2 or any(len(s) != ndim for s in shapes) or not -ndim <= dim < ndim:
        return ""
    other = [d for d in range(ndim) if d != dim % ndim and len({s[d] for s in shapes}) > 1]
    if len(other) != 1:
        return ""
    d = other[0]
    return (
        f"They differ along dim {d} only ({[s[d] for s in shapes]}): each chunk padded its "
        f"sequences to its own longest, as pad_packed_sequence does without total_length; "
        f"pad to the batch's length, pad_packed_sequence(..., total_length=x.shape[{d}]) with "
        f"x the padded input (the guide's packed sequences). "
    )


def check_chunk_sizes_of(
    values: list[Any], where: Callable[[], str], dim: int, sizes: Sequence[int]
) -> None:
    """Refuse outputs that some replicas return batched and others not, and different outputs
    from chunks of one sample: both are what a batch dimension lost to ``squeeze()`` looks like,
    and concatenating them would return the wrong number of samples."""
    batched = [
        -v.ndim <= dim < v.ndim and v.shape[dim] == n for v, n in zip(values, sizes, strict=True)
    ]
    if any(batched) or all(n == 1 for n in sizes):
        wrong = next(i for i, ok in enumerate(batched) if not ok)
        raise ValueError(
            f"{where()}: replica {wrong} returned shape {tuple(values[wrong].shape)} for a "
            f"chunk of {sizes[wrong]} sample(s), expected its chunk size along dim {dim} "
            f"({_shapes(values, sizes)}); a batch dimension squeezed away for one sample looks "
            f"like this. Keep the batch dimension (squeeze(-1) rather than squeeze()), return "
            f"the same value on every replica, say where its batch is with "
            f"output_rules={{{where()!r}: dim}} (an RNN's h_n/c_n: 1), or use gather=False"
        )


def check_scalar_weights(scalar_weights: Sequence[float], n: int) -> tuple[float, ...]:
    """``gather``'s ``scalar_weights``: one finite weight >= 0 per output."""
    weights = []
    for i, w in enumerate(scalar_weights):
        try:
            value = float(w)
        except (TypeError, ValueError, RuntimeError):
            value = -1.0
        if isinstance(w, bool) or not value >= 0 or value == float("inf"):
            raise ValueError(
                f"scalar_weights[{i}]: expected a finite number >= 0 (that chunk's weight in "
                f"the mean of scalar outputs), got {w!r}; return a count such as the number "
                f"of labels that are not -100"
            )
        weights.append(value)
    if len(weights) != n:
        raise ValueError(
            f"scalar_weights: expected one weight per output ({n}), got {len(weights)}; pass "
            f"one per replica, in batch order"
        )
    return tuple(weights)


def check_gather_sizes(chunk_sizes: Sequence[int], n: int) -> tuple[int, ...]:
    """``gather``'s ``chunk_sizes``: one non-negative int per output."""
    sizes = []
    for i, size in enumerate(chunk_sizes):
        if isinstance(size, bool) or not hasattr(size, "__index__") or operator.index(size) < 0:
            raise ValueError(
                f"chunk_sizes[{i}]: expected a non-negative int, got {size!r}; pass the "
                f"plan's chunk_sizes, or None to read them from the outputs"
            )
        sizes.append(operator.index(size))
    if len(sizes) != n:
        raise ValueError(
            f"chunk_sizes: expected one size per output ({n}), got {len(sizes)}: "
            f"{list(chunk_sizes)!r}; pass the plan's chunk_sizes, or None to read them from "
            f"the outputs"
        )
    return tuple(sizes)


# ---------------------------------------------------------------------------- replicate


def check_initialized(modules: list[nn.Module]) -> None:
    """Lazy modules (``nn.LazyLinear``) have no parameters to copy until a first forward."""
    for module in modules:
        for group in (module._parameters, module._buffers):
            for name, t in group.items():
                if t is not None and is_lazy(t):
                    raise ValueError(
                        f"module: {type(module).__name__} has an uninitialized (lazy) tensor "
                        f"{name!r}, expected initialized parameters to replicate; run one "
                        f"forward on the plain module first (module(sample_batch)), then wrap it"
                    )


def replicate_scripted(module: nn.Module, devices: tuple[torch.device, ...]) -> list[nn.Module]:
    """Replicas of a module that is, or holds, a TorchScript module.

    On CUDA, torch's own replicate (which supports them). On CPU device lists every replica is
    the module itself when it holds no buffers: one memory, as replicas on a parameter's own
    device share it anyway, and TorchScript runs concurrently. Buffers would race: refused.
    """
    if all(d.type == "cpu" for d in devices) and not any(True for _ in module.buffers()):
        return [module] * len(devices)
    if any(d.type != "cuda" for d in devices):
        raise ValueError(
            f"devices: a TorchScript module (scripted, traced, or holding a scripted child) "
            f"with buffers can only be replicated onto CUDA devices, as in torch (on one CPU "
            f"the replicas would race on its buffers), got {[str(d) for d in devices]!r}; pass "
            f"CUDA devices, one device (the module then runs as is), or the eager module"
        )
    from torch.nn.parallel.replicate import replicate as torch_replicate

    detach = not torch.is_grad_enabled()
    return list(torch_replicate(module, [d.index or 0 for d in devices], detach=detach))
