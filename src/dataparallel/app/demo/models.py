"""The tutorial's models: the CIFAR-10 classifier ``Net`` and the one-layer ``Model``.

Both keep the tutorial's structure. ``Net`` is adapted to the input: 3x32x32 CIFAR images use
the tutorial's 5x5 convolutions without padding (32 -> 28 -> 14 -> 10 -> 5), small images such
as the 8x8 digits use 3x3 convolutions with padding 1 (8 -> 8 -> 4 -> 4 -> 2), so that the
shapes work; the widths stay 6/16/120/84/classes.

``batchnorm=True`` gives the variant with BatchNorm (``dataparallel train --batchnorm`` and
``--sync-bn``): ``Net`` normalises after each convolution and each hidden linear layer,
``Model`` its input. The tutorial's models have none.

With ``trace=True`` a model prints the tutorial's line from inside ``forward``, once per replica::

    \tIn Model: input size torch.Size([10, 5]) output size torch.Size([10, 2])
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Model", "Net", "build_model", "trace_line"]


def trace_line(input: torch.Tensor, output: torch.Tensor) -> str:
    """The tutorial's in-model line, newline included."""
    return f"\tIn Model: input size {input.size()} output size {output.size()}\n"


def _emit(line: str) -> None:
    # One write per line: replicas run on threads, and print() writes the text and the newline
    # separately, so two replicas' lines could interleave.
    sys.stdout.write(line)
    sys.stdout.flush()


class Net(nn.Module):
    """The tutorial's classifier: conv, pool, conv, pool and three linear layers.

    Args:
        in_channels: 3 for CIFAR-10 (as in the tutorial), 1 for digits.
        image_size: the height and width of the square input images.
        num_classes: the number of outputs.
        trace: print the tutorial's ``In Model`` line on every forward.
        batchnorm: add a BatchNorm layer after each convolution and hidden linear layer.
    """

    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 32,
        num_classes: int = 10,
        *,
        trace: bool = False,
        batchnorm: bool = False,
    ) -> None:
        super().__init__()
        # The tutorial's 5x5 unpadded convolutions need at least 16 pixels (two of them and two
        # pools); smaller images get 3x3 convolutions that keep the size.
        kernel, padding = (5, 0) if image_size >= 16 else (3, 1)
        size = image_size
        for _ in range(2):
            size = (size + 2 * padding - kernel + 1) // 2
        if size < 1:
            raise ValueError(
                f"image_size: expected images of at least 2x2 pixels, got {image_size!r}"
            )
        self.conv1 = nn.Conv2d(in_channels, 6, kernel, padding=padding)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, kernel, padding=padding)
        self.fc1 = nn.Linear(16 * size * size, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)
        self.trace = trace
        # The plain net keeps the tutorial's modules exactly (no placeholder layers).
        self.batchnorm = batchnorm
        if batchnorm:
            self.bn1 = nn.BatchNorm2d(6)
            self.bn2 = nn.BatchNorm2d(16)
            self.bn3 = nn.BatchNorm1d(120)
            self.bn4 = nn.BatchNorm1d(84)

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if not self.batchnorm:
            return x
        out: torch.Tensor = getattr(self, name)(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores, shape ``(batch, num_classes)``."""
        out = self.pool(F.relu(self._norm("bn1", self.conv1(x))))
        out = self.pool(F.relu(self._norm("bn2", self.conv2(out))))
        # flatten(1), not the tutorial's view(-1, 16 * 5 * 5), which would silently fold a
        # wrongly shaped batch into a different batch size.
        out = out.flatten(1)
        out = F.relu(self._norm("bn3", self.fc1(out)))
        out = F.relu(self._norm("bn4", self.fc2(out)))
        out = self.fc3(out)
        if self.trace:
            _emit(trace_line(x, out))
        return out


class Model(nn.Module):
    """The tutorial's data-parallel demo model: one linear layer and a print.

    Args:
        input_size: size of each input vector (5 in the tutorial).
        output_size: size of each output vector (2 in the tutorial).
        trace: print the tutorial's ``In Model`` line on every forward.
        batchnorm: normalise the input with a BatchNorm layer first.
    """

    def __init__(
        self, input_size: int, output_size: int, *, trace: bool = False, batchnorm: bool = False
    ) -> None:
        super().__init__()
        if batchnorm:
            self.bn = nn.BatchNorm1d(input_size)
        self.batchnorm = batchnorm
        self.fc = nn.Linear(input_size, output_size)
        self.trace = trace

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``fc(input)``, printing the sizes when tracing."""
        output: torch.Tensor = self.fc(self.bn(input) if self.batchnorm else input)
        if self.trace:
            _emit(trace_line(input, output))
        return output


def build_model(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    trace: bool = False,
    batchnorm: str = "none",
) -> nn.Module:
    """The tutorial model for an input shape: ``Net`` for images ``(C, H, W)``, ``Model`` for
    vectors ``(size,)``. ``batchnorm``: ``"none"`` (the tutorial's), ``"chunk"`` (the variant
    with ``nn.BatchNorm*``, which DataParallel runs per chunk) or ``"sync"`` (the same layers
    as ``nn.SyncBatchNorm``, synchronised over the replicas).

    Raises:
        ValueError: the shape is neither.
    """
    if batchnorm not in ("none", "chunk", "sync"):
        raise ValueError(f"batchnorm: expected 'none', 'chunk' or 'sync', got {batchnorm!r}")
    with_bn = batchnorm != "none"
    model: nn.Module
    if len(input_shape) == 1:
        model = Model(input_shape[0], num_classes, trace=trace, batchnorm=with_bn)
    elif len(input_shape) == 3 and input_shape[1] == input_shape[2]:
        model = Net(input_shape[0], input_shape[1], num_classes, trace=trace, batchnorm=with_bn)
    else:
        raise ValueError(
            f"input_shape: expected (size,) or square images (C, H, H), got {input_shape!r}"
        )
    if batchnorm == "sync":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model
