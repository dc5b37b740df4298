"""Tests of ``dataparallel.app``: the command line, its launcher and the demo."""
