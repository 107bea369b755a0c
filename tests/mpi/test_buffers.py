"""A model's buffers (BatchNorm) kept in agreement under every algorithm, under real mpirun.

One launch (4 ranks, 2 nodes of 2) runs every phase of tests/workers/api_buffers.py: SSGD's
buffers are rank 0's after every step, BMUF's the mean of every learner's at a block
boundary and in its evaluation model, ADPSGD's agree in each super-learner and are the mean
in its evaluation model, and with ``sync_buffers=False`` each learner keeps its own.
"""

from __future__ import annotations

import pytest

from tests._commands import run_worker_warm
from tests._mpi import assert_ok

pytestmark = pytest.mark.mpi


def test_batchnorm_buffers_agree_under_every_algorithm():
    res = run_worker_warm(4, "api_buffers", env={"HADPSGD_RANKS_PER_NODE": "2"})
    assert_ok(res)
    for phase in ("ssgd", "bmuf", "adpsgd", "off"):
        assert res.stdout.count(f"OK {phase} rank") == 4, res.output[-4000:]
