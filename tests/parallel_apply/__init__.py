"""Tests of ``dataparallel.parallel_apply``, a file per module or per mechanism."""
