"""Tests of ``dataparallel.scatter``, a file per module or per mechanism."""
