"""Tests of ``dataparallel.gather``, a file per module or per mechanism."""
