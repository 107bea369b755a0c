"""Forwards to :mod:`lab.studies`: the paper studies moved there (their old paths still run)."""
