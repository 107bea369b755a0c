"""The communication microbenchmark end to end under real mpirun (tiny sweeps)."""

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.comm.report import bus_factor
from tests._mpi import ROOT, assert_ok, run_mpi

pytestmark = pytest.mark.mpi

QUICK = ["--max-bytes", "4096", "--iters", "2", "--warmup", "1", "--max-time", "0.01"]


def _summary(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith('{"benchmark": "comm"')]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


def _check_rows(rows: list[dict], nranks: int, local: int, gloo: bool = True) -> None:
    for r in rows:
        n = {"exchange": 2, "intra": local}.get(r["op"], nranks)
        factor = bus_factor(r["op"], n)
        assert r["bus_factor"] == pytest.approx(factor)
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
        assert r["count"] * 4 == r["size_bytes"] and r["iters"] >= 1
        for key in ("time_us", "mpi4py_time_us", "ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        if gloo and r["name"] == "allreduce/flat":
            assert math.isfinite(r["gloo_ratio"]) and r["gloo_ratio"] > 0
            assert r["gloo_time_us"] / r["time_us"] == pytest.approx(r["gloo_ratio"])


def test_driver_launches_and_reports_every_op(tmp_path):
    """The default mode: the driver starts 4 ranks as 2 emulated nodes of 2."""
    out = tmp_path / "comm.json"
    env = dict(os.environ, HADPSGD_TIMEOUT="300")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "benchmarks.comm", "-n", "4", "--ranks-per-node", "2",
           "--op", "all", *QUICK, "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    record = json.loads(out.read_text())
    rows = record["rows"]
    names = {r["name"] for r in rows}
    assert names == {"allreduce/flat", "allreduce/hier", "broadcast", "exchange", "intra/mpi",
                     "intra/gloo", "allreduce/hier[mpi]", "allreduce/hier[gloo]"}
    sizes = record["options"]["sizes"]
    assert sizes[0] == 8 and sizes[-1] == 4096
    for name in names:
        assert sorted(r["size_bytes"] for r in rows if r["name"] == name) == sizes, name
    _check_rows(rows, nranks=4, local=2)
    assert record["topology"]["node_sizes"] == [2, 2]
    summary = _summary(res.stdout)
    assert summary == record["summary"]
    assert "2 emulated nodes" in summary["layout"]
    for key in ("allreduce_flat_latency_ratio_le_1KiB", "allreduce_hier_latency_ratio_le_1KiB"):
        assert math.isfinite(summary[key]) and summary[key] > 0
    assert summary["allreduce_flat_ratio_ge_1MiB"] is None  # no size >= 1 MiB in this sweep
    assert set(summary["intra_gloo_vs_mpi"]) == {"intra", "allreduce/hier"}
    assert "allreduce/hier" in res.stdout and "busbw" in res.stdout  # the table


def test_runs_inside_an_existing_mpi_job(tmp_path):
    """Cluster mode: started by mpirun itself, one node, no hierarchical rows."""
    out = tmp_path / "comm.json"
    res = run_mpi(2, ["-m", "benchmarks.comm", "--op", "allreduce", "exchange", *QUICK,
                      "--max-bytes", "64", "--no-gloo", "--json", str(out)], timeout=600)
    assert_ok(res)
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert {r["name"] for r in rows} == {"allreduce/flat", "exchange"}
    assert all(r["gloo_ratio"] is None for r in rows)
    _check_rows(rows, nranks=2, local=2, gloo=False)
    summary = _summary(res.stdout)
    assert summary["allreduce_hier_ratio_ge_1MiB"] is None
    # The CPU mode records where the buffers were, and adds no GPU columns or keys.
    assert record["options"]["device"] == "cpu"
    device = record["device"]
    assert (device["type"], device["cuda_aware"], device["intra_backend"]) == ("cpu", False, "mpi")
    assert device["route"] == {"intra": "mpi", "inter": "mpi"}
    assert all("device_ratio" not in r and "route" not in r for r in rows)
    assert "device" not in summary
    assert "mpi4py-dev" not in res.stdout and "gloo" in res.stdout  # the CPU table header
