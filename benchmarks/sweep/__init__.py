"""Forwards ``python -m benchmarks.sweep`` to ``python -m lab.sweep`` (moved to :mod:`lab`)."""
