"""Tests of ``dataparallel.wrapper``, a file per module or per mechanism."""
