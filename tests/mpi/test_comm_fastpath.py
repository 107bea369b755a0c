"""The direct path of the reductions under real mpirun: same results, same deadline.

A contiguous host tensor that fits in one bucket goes straight to one guarded MPI allreduce
(``Reducer.direct_sum_``); it must equal the general path bit for bit, and a peer that never
arrives must still end the job within the deadline with an error naming it (that one is
``tests/mpi/test_comm_layer.py::test_missing_peer_is_named_within_deadline``, flat and auto).
"""

import pytest

from tests._commands import run_worker_warm
from tests._mpi import assert_ok

pytestmark = pytest.mark.mpi

# ~1 KiB buckets: 262 float32 / 131 float64 elements, so the worker's sizes fall on both sides.
SMALL_BUCKET = {"HADPSGD_BUCKET_MB": "0.001"}


@pytest.mark.parametrize(
    ("nprocs", "per_node", "backend"),
    [(2, None, "mpi"), (3, None, "gloo"), (4, "2", "mpi"), (3, "1", "mpi"), (5, "2", "mpi")],
    ids=["flat-2", "one-node-gloo-3", "2x2", "3x1", "unequal-2-2-1"],
)
def test_direct_path_equals_general_path(nprocs, per_node, backend):
    env = {**SMALL_BUCKET, "HADPSGD_INTRA_BACKEND": backend}
    if per_node:
        env["HADPSGD_RANKS_PER_NODE"] = per_node
    res = run_worker_warm(nprocs, "comm_fastpath", env=env)
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs
