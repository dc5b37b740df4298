"""Tests of ``dataparallel.plan``, one file per module."""
