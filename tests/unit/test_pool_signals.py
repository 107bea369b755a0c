"""ADPSGD's shared control counters: what a learner posts reaches the guards intact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hadpsgd.api.samplers import POOL_SLOTS
from hadpsgd.comm.meetings import Group, ThreadCounter
from hadpsgd.train.control import DivergedError, DivergenceGuard
from hadpsgd.train.pooled import LOSS_CAP, _Signals


def test_a_diverging_learners_huge_loss_reaches_the_guard_not_an_overflow():
    # Seen on speechocean762 (ADPSGD --wire topk, 16 learners): the training loss climbed
    # past 4,946 to ~1e13 and beyond, still finite; posted in millionths to the int64 pool
    # counter it raised OverflowError on every rank, a traceback instead of the divergence
    # guard's exit 4. The loss is posted capped, so the mean still trips the guard.
    pool = ThreadCounter(Group([0], timeout=5.0), 0, POOL_SLOTS)
    control = SimpleNamespace(stop=SimpleNamespace(requested=False), nonfinite=[])
    signals = _Signals(pool, control, max_nonfinite=0)
    assert signals.post(3.5, log=True)[2] == pytest.approx(3.5)
    guard = DivergenceGuard(max_ratio=5.0, patience=1)
    guard.training(3.5, 1)
    for huge in (4945.99, 1e13, 1e20, 1.7e308):
        _, _, mean = signals.post(huge, log=True)
        assert mean == pytest.approx(min(huge, LOSS_CAP))
        with pytest.raises(DivergedError, match="training loss"):
            guard.training(mean, 2)
