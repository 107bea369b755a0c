"""benchmarks/comm/pipeline_progress.py: the pipelined mean with and without its progress
tests beside the serial one, in one job per node backend (issue 59 item 4)."""

import json
import subprocess
import sys

import pytest

from benchmarks.comm.pipeline_progress import add_ratios, table
from tests._mpi import ROOT


def test_ratios_against_the_same_jobs_serial_route():
    rows = [{"intra": "GlooIntra", "route": "serial", "seconds": 0.2},
            {"intra": "GlooIntra", "route": "pipelined, progress tests", "seconds": 0.1,
             "early": 0.5},
            {"intra": "MPIIntra", "route": "serial", "seconds": 0.1},
            {"intra": "MPIIntra", "route": "pipelined, progress tests", "seconds": 0.2,
             "early": 1.0}]
    add_ratios(rows)
    assert [r["serial_over"] for r in rows] == [1.0, 2.0, 1.0, 0.5]
    text = table(rows)
    assert "2.00x" in text and "50%" in text and "0.50x" in text


@pytest.mark.mpi
def test_every_route_runs_under_each_node_backend(tmp_path):
    out = tmp_path / "pp.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.comm.pipeline_progress", "--mib",
                          "0.25", "--piece-mb", "0.05", "--rounds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["intra"], r["route"]) for r in rows} == {
        (intra, route) for intra in ("GlooIntra", "MPIIntra")
        for route in ("serial", "pipelined, no progress tests", "pipelined, progress tests")}
    for r in rows:
        assert r["seconds"] > 0 and r["serial_over"] > 0
        assert r["route"] == "serial" or 0.0 <= r["early"] <= 1.0
