"""benchmarks/training/link.py: the main command on two emulated hosts, the link's bytes beside
the run's own count (needs root, iproute2 and Open MPI; skipped elsewhere with the reason)."""

import json
import subprocess
import sys

import pytest

from benchmarks._common.netns import available
from benchmarks.training.link import add_ratios, table
from tests._mpi import ROOT

OK, WHY = available()


def test_ratios_and_table_from_rows():
    rows = [{"config": "ssgd", "link_per_step": 1000.0, "link_whole_run": 9000.0,
             "counted_per_step": 950.0, "control_per_step": 0.0},
            {"config": "hadpsgd-topk", "link_per_step": 10.0, "link_whole_run": 900.0,
             "counted_per_step": 5.0, "control_per_step": 1.0}]
    add_ratios(rows)
    assert rows[1]["ssgd_over_link_per_step"] == 100.0
    assert rows[1]["ssgd_over_link_whole_run"] == 10.0
    assert rows[1]["link_over_counted"] == 2.0
    text = table(rows)
    assert "hadpsgd-topk" in text and "100x" in text


@pytest.mark.mpi
@pytest.mark.skipif(not OK, reason=f"two emulated hosts: {WHY}")
def test_link_bytes_beside_the_runs_count(tmp_path):
    out = tmp_path / "link.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.training.link", "--preset", "tiny",
                          "--steps", "4", "12", "--configs", "ssgd", "hadpsgd-topk",
                          "--json", str(out), "--", "--batch-size", "8"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    ssgd, topk = rows["ssgd"], rows["hadpsgd-topk"]
    # SSGD's count is what its gradients put on the link, within the transport's headers
    assert 0.95 <= ssgd["link_over_counted"] <= 1.3
    # H-ADPSGD's count holds its pairing and pool: control bytes, and a payload far below SSGD
    assert topk["counted"]["world_control_bytes"] > 0
    # (over the whole run: 8 steps of a tiny model's gossip are too few for a per-step figure,
    # the number of exchanges varies from run to run)
    assert topk["link_whole_run"] >= topk["counted_whole_run"] > 0
    assert topk["ssgd_over_link_whole_run"] > 2
    assert "all ranks:" in topk["runs"][1]["last_line"]
    # The start's broadcast of the model, said apart, crossed the link at least once: what
    # does not grow with the steps is at least that on the link, and is all of SSGD's count
    assert ssgd["counted_startup"] > 0
    assert "at start rank 0's model" in ssgd["runs"][1]["last_line"]
    assert ssgd["counted_fixed"] == pytest.approx(ssgd["counted_startup"], rel=1e-6)
    assert ssgd["link_fixed"] >= 0.9 * ssgd["counted_startup"]
