"""Tests of ``dataparallel._common``, a file per module or per mechanism."""
