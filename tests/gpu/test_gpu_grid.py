"""The one-GPU grid on one tiny cell, with its profile and the forward check (skipped without
CUDA): every part ends in the record with figures, not only an exit code."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests._mpi import ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_one_tiny_cell_profile_and_forward(tmp_path):
    report = tmp_path / "grid.md"
    cmd = [sys.executable, "-m", "benchmarks.training.gpu_grid", "--preset", "tiny",
           "--classes", "64", "--batch", "4", "--precision", "bf16", "--layout", "stacked",
           "--steps", "6", "--log-every", "2", "--profile-cell", "4/bf16/stacked",
           "--forward-preset", "tiny", "--work", str(tmp_path / "work"), "--report",
           str(report), "--budget", "200"]
    env = dict(os.environ, HADPSGD_TIMEOUT="60")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
        env.pop(name, None)  # the driver launches its own ranks
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rec = json.loads(report.with_suffix(".json").read_text())
    (row,) = rec["rows"]
    assert row["key"] == "4/bf16/stacked" and row["status"] == "ok"
    assert _positive(row["hadpsgd"]["frames_per_s"]) and _positive(row["plain"]["frames_per_s"])
    assert _positive(row["ratio"]) and row["hadpsgd"]["windows"] == 2
    assert "warning" not in row["hadpsgd"], row["hadpsgd"]
    for side in ("hadpsgd", "plain"):
        summary = rec["profile"][side]["summary"]
        assert summary["steps"] == 2 and summary["top"], side
        assert 0 < summary["gpu_busy_frac"] <= 1.0
    fwd = rec["forward"]
    assert "error" not in fwd, fwd
    assert fwd["same_offsets"] and fwd["max_abs_diff"] < 0.1 and fwd["argmax_agree"] > 0.5
    assert fwd["cuda"]["frames"] == fwd["cpu"]["frames"] == fwd["frames"]
    assert "## Targets" in report.read_text()
