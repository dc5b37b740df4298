"""Benchmarks of ``dataparallel``: every cost measured beside its baseline, in the same run.

``python -m benchmarks`` runs the full CPU set, ``python -m benchmarks --quick`` the quick set
(what ``dataparallel bench`` runs); ``benchmarks/bench_gpu.py`` is the GPU set and
``benchmarks/bench_ddp.py`` the DDP path. Each writes JSON and prints a table of ratios.
"""

from __future__ import annotations

__all__: list[str] = []
