"""dataparallel: run one PyTorch module over many devices on one batch, and get the batch right.

>>> import torch, dataparallel as dp
>>> dp.plan((torch.zeros(10, 3), torch.zeros(1, 4)), None, ["cpu", "cpu"]).chunk_sizes
[5, 5]
"""

from __future__ import annotations

from dataparallel.devices import resolve_devices
from dataparallel.markers import Shared, Split
from dataparallel.plan import Entry, Plan, Vote, plan
from dataparallel.scatter import scatter, scatter_kwargs

__version__ = "0.1.0"

__all__ = [
    "Entry",
    "Plan",
    "Shared",
    "Split",
    "Vote",
    "__version__",
    "plan",
    "resolve_devices",
    "scatter",
    "scatter_kwargs",
]
