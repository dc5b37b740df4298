"""Tests of ``dataparallel.replicate``, one file per module."""
