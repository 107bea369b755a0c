"""The flat MPI collectives and the deadline, under real mpirun."""

import re

import pytest

from tests.conftest import assert_ok, run_worker

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_collectives_match_reference(nprocs):
    res = run_worker(nprocs, "comm_ops")
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs


def test_missing_peer_becomes_error_within_deadline():
    res = run_worker(3, "deadline", env={"HADPSGD_TIMEOUT": "3"}, timeout=120)
    lines = re.findall(r"TIMEOUT rank (\d) after ([\d.]+)s: (.*)", res.stdout)
    assert sorted(int(r) for r, _, _ in lines) == [1, 2], res.output
    for _, seconds, msg in lines:
        assert float(seconds) < 3 + 5  # bounded: the deadline plus polling slack
        assert "allreduce" in msg and "HADPSGD_TIMEOUT" in msg
    assert res.returncode != 0
