"""The received-bytes count (benchmarks/comm/received.py) under real mpirun."""

import json
import subprocess
import sys

import pytest

from tests._mpi import MPI_TIMEOUT_S, ROOT

pytestmark = pytest.mark.mpi


def test_received_bytes_follow_each_exchange_pattern(tmp_path):
    """Counts against the patterns' own formulas (not the code's): a ring allreduce of the
    fp32 gradient receives 2 (N - 1) / N of it; a gossip exchange receives one whole model
    (and its 4-byte flag) at any N; the codecs' block syncs shrink in their order."""
    out = tmp_path / "received.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.comm.received", "--learners", "2",
                          "4", "--preset", "small", "--steps", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=2 * MPI_TIMEOUT_S, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "N=64" not in res.stdout and "topk 1/64" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    by = {(r["config"], r["learners"]): r for r in rows}
    params = rows[0]["params"]
    for n in (2, 4):
        ring = 2 * (n - 1) * 4 * params // n
        assert by[("ssgd fp32", n)]["received"] == pytest.approx(ring, rel=1e-6)
        assert by[("adpsgd fp32", n)]["received"] == 4 * params + 4
        sizes = [by[(c, n)]["received"] for c in ("bmuf fp32", "bmuf int8", "bmuf int4",
                                                   "bmuf topk 1/16", "bmuf topk 1/64")]
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] > 0
        assert all(by[(c, n)]["received"] == by[(c, n)]["sent"] for c in
                   ("ssgd fp32", "bmuf int8", "bmuf topk 1/64"))
    # a two-stage mean densifies in the middle: 2 (N - 1) / N of one encoded tensor, so going
    # from 2 to 4 learners multiplies it by 1.5 (not by 3, as N - 1 whole sparse messages)
    growth = by[("bmuf topk 1/64", 4)]["received"] / by[("bmuf topk 1/64", 2)]["received"]
    assert growth == pytest.approx(1.5, rel=0.05)
