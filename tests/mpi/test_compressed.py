"""The compressed cross-node mean under real mpirun (int8 gossip: tests/mpi/test_adpsgd.py).

``tests/workers/compressed.py`` checks the mean (bit-identical everywhere, within the
rounding bounds, error feedback telescoping, exact resume, bytes).
"""

import pytest

from tests._mpi import assert_ok, run_worker

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("nprocs", "per_node"), [(4, "2"), (4, "1"), (3, "1")],
                         ids=["2x2", "4x1", "3x1"])
def test_compressed_mean(nprocs, per_node):
    res = run_worker(nprocs, "compressed", env={"HADPSGD_RANKS_PER_NODE": per_node,
                                                "HADPSGD_TIMEOUT": "60"})
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs
