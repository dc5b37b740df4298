"""Tests of ``dataparallel.app.demo``."""
