"""Gradient reduction overlapped with backward, under real mpirun (tests/workers/overlap.py)."""

import pytest

from tests._commands import run_worker_warm
from tests._mpi import assert_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("algo", "nprocs", "ranks_per_node"), [
    ("ssgd", 2, None), ("ssgd", 4, "2"), ("bmuf", 4, "2"), ("adpsgd", 4, "2")])
def test_overlapped_reduction_trains_bit_identically(algo, nprocs, ranks_per_node):
    env = {"HADPSGD_RANKS_PER_NODE": ranks_per_node} if ranks_per_node else {}
    res = run_worker_warm(nprocs, "overlap", algo, env=env)
    assert_ok(res)
    assert res.stdout.count(" OK") == nprocs


@pytest.mark.parametrize(("nprocs", "ranks_per_node"), [(4, "2"), (5, "3")])
def test_pipelined_hierarchical_mean_is_the_mean_and_trains_as_serial(nprocs, ranks_per_node):
    """4 = 2 nodes of 2 (the shard form); 5 = nodes of 3 and 2 (the leader form)."""
    res = run_worker_warm(nprocs, "pipeline", env={"HADPSGD_RANKS_PER_NODE": ranks_per_node})
    assert_ok(res)
    assert res.stdout.count(" OK") == nprocs
