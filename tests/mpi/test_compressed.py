"""Compressed wire formats under real mpirun: the cross-node mean and ADPSGD's gossip.

``tests/workers/compressed.py`` checks the mean (bit-identical everywhere, within the
rounding bounds, error feedback telescoping, exact resume, bytes); the gossip case reuses
ADPSGD's property worker with an int8 wire: the replicas' sum is still conserved.
"""

import json

import pytest
import torch

from hadpsgd.comm import payload_bytes
from tests.conftest import assert_ok, run_worker

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("nprocs", "per_node"), [(4, "2"), (4, "1"), (3, "1")],
                         ids=["2x2", "4x1", "3x1"])
def test_compressed_mean(nprocs, per_node):
    res = run_worker(nprocs, "compressed", env={"HADPSGD_RANKS_PER_NODE": per_node,
                                                "HADPSGD_TIMEOUT": "60"})
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs


def test_int8_gossip_conserves_the_sum_of_replicas(tmp_path):
    n = 4
    env = {"HADPSGD_RANKS_PER_NODE": "1", "HADPSGD_TIMEOUT": "30", "ADPSGD_TEST_STEPS": "20",
           "ADPSGD_TEST_WIRE": "int8"}
    assert_ok(run_worker(n, "adpsgd_props", "conserve", str(tmp_path), env=env))
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    w0 = torch.tensor(recs[0]["w0"], dtype=torch.float64)
    total = sum(torch.tensor(x["flat"], dtype=torch.float64) for x in recs)
    lr, steps = recs[0]["lr"], recs[0]["steps"]
    expected = n * w0 - lr * steps * sum(x["g"] for x in recs)
    assert float((total - expected).norm() / expected.norm()) < 1e-5
    assert sum(x["exchanges"] for x in recs) > 0
    # Bytes: the payload (1025 float64 values: 1025 bytes + 2 scales) and a flag per round,
    # against 8 * 1026 for the parameters as they are.
    size = payload_bytes(w0.numel(), "int8") + 1
    assert size * 7 < payload_bytes(w0.numel() + 1, "fp32", elem_size=8)
    assert all(x["wire_bytes"] == x["rounds"] * size for x in recs)
