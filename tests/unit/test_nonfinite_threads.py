"""A NaN gradient on one learner is skipped by every learner that shares its reduction, on
learners as threads (``tests/nonfinite_suite.py``'s checks: origins, losses, skipped steps,
each step's verdict, identical replicas, finite parameters). SSGD over 3 learners, BMUF and
H-ADPSGD over 2 super-learners of 2 (ADPSGD's gossip thread on the thread world's pair
channel). Through the main command under mpirun: ``tests/mpi/test_nonfinite.py``."""

from __future__ import annotations

import pytest

from hadpsgd.comm.threads import ThreadJob
from tests.nonfinite_suite import check_nonfinite


@pytest.mark.parametrize(("algo", "size", "per_node"), [("ssgd", 3, 1), ("bmuf", 4, 2),
                                                           ("adpsgd", 4, 2)])
def test_nan_gradient_skipped_together(algo: str, size: int, per_node: int) -> None:
    failures = ThreadJob(size, per_node, timeout=60).run(lambda w: check_nonfinite(w, algo))
    assert failures == [[] for _ in range(size)], failures
