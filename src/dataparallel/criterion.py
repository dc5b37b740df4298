"""``DataParallelCriterion``: a loss computed on each device from that device's outputs.

With a ``DataParallel(..., gather=False)`` model the outputs stay where the replicas made them;
the criterion splits the targets with the same chunk sizes onto the same devices, runs the loss
there, and combines the per-device losses on one device: exactly, for torch's mean-reduced
losses (a sum per device, one division by the global count: ``gather._loss``), else as the
chunk-weighted mean. It is the pipeline again (plan, scatter, replicate, parallel_apply,
gather) with the outputs already placed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from dataparallel.devices import DeviceSpec, resolve_devices, target_device
from dataparallel.gather import (
    ScalarMode,
    SumAndCount,
    check_scalars,
    combine,
    gather,
    is_exact_mean,
)
from dataparallel.parallel_apply import parallel_apply
from dataparallel.plan import build_plan
from dataparallel.replicate import replicate
from dataparallel.scatter import take
from dataparallel.wrapper import DeviceOutputs

__all__ = ["DataParallelCriterion"]


class DataParallelCriterion(nn.Module):
    """Compute a loss on each device from that device's outputs and targets.

    Use it with a ``DataParallel(..., gather=False)`` model: the outputs stay where they were
    computed, the targets are split with the same chunk sizes onto the same devices, and the
    per-device losses come back as their chunk-weighted mean on the output device (for a
    mean-reduced criterion this equals the single-device loss). A plain, gathered output is
    passed to the criterion unchanged.

    Args:
        criterion: the loss module, e.g. ``nn.CrossEntropyLoss()``.
        device_ids: as for ``DataParallel`` (used only to resolve ``output_device``).
        output_device: where the loss lands; default the first output's device.
        dim: the batch dimension of the targets.
        scalars: ``"mean"`` for mean-reduced criteria, ``"sum"`` for sum-reduced ones;
            ``None`` (default) reads the criterion's ``reduction`` on each call (``"sum"``
            sums, else mean).

    The criterion is used as it is on each call, not copied: a change made to it after
    construction (``loss.label_smoothing = 0.1``, ``ignore_index``, ``reduction``, ``weight``,
    or ``self.criterion = other``) applies from the next call on, as on one device.

    Raises:
        TypeError: ``criterion`` is not callable.
        ValueError: a bad device spec or ``scalars``; at a call, targets whose size is not the
            outputs' batch (the message names the argument).

    Example:
        >>> import torch, dataparallel as dp
        >>> model = dp.DataParallel(torch.nn.Linear(4, 3), ["cpu", "cpu"], gather=False)
        >>> loss_fn = dp.DataParallelCriterion(torch.nn.CrossEntropyLoss())
        >>> x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
        >>> loss = loss_fn(model(x), y)  # each device's chunk against its targets
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(model.module(x), y))
        True
    """

    def __init__(
        self,
        criterion: nn.Module | Callable[..., Any],
        device_ids: DeviceSpec | Sequence[DeviceSpec] | None = None,
        output_device: DeviceSpec | None = None,
        dim: int = 0,
        *,
        scalars: str | None = None,
    ) -> None:
        """Check ``criterion``, the devices and ``scalars`` now (the class's Args)."""
        super().__init__()
        if not callable(criterion):
            raise TypeError(
                f"criterion: expected a loss module such as nn.CrossEntropyLoss() or a loss "
                f"function such as F.cross_entropy, got {type(criterion).__name__}; pass one"
            )
        self.criterion = criterion
        self.device_ids = resolve_devices(device_ids)
        self.output_device = (
            None if output_device is None else target_device(output_device, where="output_device")
        )
        self.dim = dim
        self._scalars: ScalarMode | None = None if scalars is None else check_scalars(scalars)
        # torch's mean-reduced losses: sum per device, divide once by the global count. One
        # SumAndCount per criterion object, made on first use and kept (its replicas are
        # cached with it); kept out of the module tree, so state_dict is the criterion's alone.
        self.__dict__["_exact"] = None

    @property
    def scalars(self) -> ScalarMode:
        """How per-device scalar losses combine: the ``scalars`` given, else read from the
        criterion's ``reduction`` now (``"sum"`` sums, else ``"mean"``)."""
        if self._scalars is not None:
            return self._scalars
        return "sum" if getattr(self.criterion, "reduction", None) == "sum" else "mean"

    @scalars.setter
    def scalars(self, value: str | None) -> None:
        self._scalars = None if value is None else check_scalars(value)

    def _exact_runner(self) -> SumAndCount | None:
        """The SumAndCount for the criterion as it is now, or None when its mean is not one
        to take exactly (another reduction, a loss of the user's, ``scalars="sum"``)."""
        criterion = self.criterion
        if self.scalars != "mean" or not is_exact_mean(criterion):
            return None
        exact: SumAndCount | None = self.__dict__["_exact"]
        if exact is None or exact.criterion is not criterion:
            exact = self.__dict__["_exact"] = SumAndCount(criterion)
        return exact

    def forward(self, outputs: Any, *targets: Any, **kwargs: Any) -> Any:
        """The loss of ``outputs`` against ``targets``, computed where the outputs are.

        Args:
            outputs: a ``gather=False`` call's ``DeviceOutputs``; anything else is passed to
                the criterion unchanged.
            *targets: the targets for the whole batch, split as the outputs were.
            **kwargs: the criterion's keyword arguments, split by the same rules.

        Returns:
            The loss on the output device: the one-device loss for torch's mean-reduced losses.
        """
        if not isinstance(outputs, DeviceOutputs):
            return self.criterion(outputs, *targets, **kwargs)
        devices, sizes = outputs.devices, outputs.chunk_sizes
        plan = build_plan(
            targets,
            kwargs,
            devices,
            self.dim,
            # an empty batch (one chunk of 0) is decided by the targets' vote
            batch_size=sum(sizes) or None,
            chunk_sizes=sizes if sum(sizes) else None,
            strict=True,
        )
        chunks = [take(plan, s, n, d) for d, s, n in plan.slices[0]]
        args = [(out, *chunk_args) for out, (chunk_args, _) in zip(outputs, chunks, strict=True)]
        chunk_kwargs = [k for _, k in chunks]
        target = self.output_device or devices[0]
        if len(outputs) == 1:
            losses = [self.criterion(*args[0], **chunk_kwargs[0])]
        else:
            exact = self._exact_runner()
            runner = exact or self.criterion
            # A loss function has no state to copy: every device calls it as it is.
            replicas: Any = (
                replicate(runner, devices)
                if isinstance(runner, nn.Module)
                else [runner] * len(devices)
            )
            losses = parallel_apply(replicas, args, chunk_kwargs, devices)
            if exact is not None:
                return combine(losses, target)
        return gather(losses, target, self.dim, chunk_sizes=sizes, scalars=self.scalars)
