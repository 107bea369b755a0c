"""The compressed cross-node mean under real mpirun (int8 gossip: tests/mpi/test_adpsgd.py).

``tests/workers/compressed.py`` checks the mean (bit-identical everywhere, within the
rounding bounds, error feedback telescoping, exact resume, bytes);
``tests/workers/half_mean_nodes.py`` checks ``--grad-wire bf16`` across nodes (through the
main command's trainer: ``tests/unit/test_precision_threads.py``, on learners as threads).
"""


import pytest

from tests._commands import run_worker_warm
from tests._mpi import assert_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("nprocs", "per_node"), [(4, "2"), (4, "1"), (3, "1")],
                         ids=["2x2", "4x1", "3x1"])
def test_compressed_mean(nprocs, per_node):
    res = run_worker_warm(nprocs, "compressed", env={"HADPSGD_RANKS_PER_NODE": per_node,
                                                "HADPSGD_TIMEOUT": "60"})
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs


@pytest.mark.parametrize(("nprocs", "per_node", "algo", "intra"),
                         [(4, "2", "auto", "mpi"), (4, "2", "leader", "mpi"),
                          (4, "1", "auto", "mpi"), (4, "2", "auto", "gloo"),
                          (5, "2", "auto", "mpi")],
                         ids=["2x2-shard", "2x2-leader", "4x1", "2x2-gloo", "2+2+1-leader"])
def test_grad_wire_bf16_across_nodes_is_fp32_inside_and_bf16_between(nprocs, per_node, algo,
                                                                      intra):
    """``--grad-wire bf16`` over ranks in nodes (``tests/workers/half_mean_nodes.py``): bit
    for bit the reference of fp32 node means rounded to bf16 across the nodes, the same bits
    on every rank, and the bytes counted those that crossed between nodes: half of the fp32
    hierarchical allreduce's (on the counter of the inter-node communicator). Nodes of
    unequal size take the leader form. With gloo inside the nodes its rendezvous store waits
    ``HADPSGD_TIMEOUT``."""
    res = run_worker_warm(nprocs, "half_mean_nodes", algo,
                     env={"HADPSGD_RANKS_PER_NODE": per_node, "HADPSGD_TIMEOUT": "47",
                          "HADPSGD_INTRA_BACKEND": intra})
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs
    if nprocs == 5:
        assert "local 0 sent 0" not in res.stdout  # every node's leader sent its share
