"""BMUF under real mpirun, held to the same suite on learners as threads.

The equations are checked on the in-process world (``tests/unit/test_bmuf_threads.py``:
every configuration against the NumPy reference, on four layouts). What MPI adds is checked
here, in one launch of the 2 x 2 layout (two super-learners of two: the node's allreduce,
the block sync across nodes): every configuration ends in the same states as on threads
(before and after the closing ``finish()``; at a tolerance, MPI may sum in another order),
the replicas agree after every sync and the node's members after every step, ``sync()``
changes nothing, and a mid-block resume is bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hadpsgd.comm.threads import ThreadJob
from tests._commands import run_worker_warm
from tests._mpi import assert_ok
from tests.bmuf_suite import run_suite
from tests.workers.bmuf_common import MAIN

pytestmark = pytest.mark.mpi
RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    mpi, threads = tmp_path_factory.mktemp("mpi"), tmp_path_factory.mktemp("threads")
    res = run_worker_warm(4, "bmuf_ref", "main", str(mpi), "1", env={"HADPSGD_RANKS_PER_NODE": "2"})
    assert_ok(res)
    assert res.stdout.count("OK rank") == 4
    ThreadJob(4, 2, timeout=120).run(lambda w: run_suite(w, "main", threads, [1]))
    return mpi, threads


@pytest.mark.parametrize("c", MAIN, ids=[c["name"] for c in MAIN])
def test_mpi_ends_where_the_threads_do(both: tuple[Path, Path], c: dict) -> None:
    with np.load(both[0] / f"{c['name']}-g1.npz") as f:
        mpi = dict(f)
    with np.load(both[1] / f"{c['name']}-g1.npz") as f:
        threads = dict(f)
    assert set(mpi) == set(threads)
    for key, value in threads.items():
        if key.startswith(("before_", "after_", "resume_", "ssgd", "plain")):
            np.testing.assert_allclose(mpi[key], value, rtol=RTOL, atol=ATOL, err_msg=key)
    assert mpi["replicas_ok"] and mpi["node_ok"], c["name"]
    assert mpi["sync_noop"] and mpi["num_syncs"] == threads["num_syncs"]
    for key in [k for k in mpi if k.startswith("resume_a_")]:  # bit-exact under MPI too
        assert np.array_equal(mpi[key], mpi[key.replace("resume_a_", "resume_b_")]), key
