"""Shared fixtures: a small synthetic dataset (the mpirun helpers are in ``tests/_mpi.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small synthetic train/held-out pair (fast to train on with the tiny preset)."""
    from hadpsgd.data.synth import SynthSpec, generate

    out = tmp_path_factory.mktemp("data")
    spec = SynthSpec(feat_dim=260, num_classes=12, train_utts=60, heldout_utts=12,
                     min_len=60, max_len=120, seed=3)
    return generate(out, spec)
