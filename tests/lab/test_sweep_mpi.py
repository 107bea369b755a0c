"""A 2-cell sweep end to end under real mpirun, its plots, and a rerun that skips both cells."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests._mpi import ROOT

pytestmark = pytest.mark.mpi


def _sweep(sweep_dir, data, timeout: float = 600) -> subprocess.CompletedProcess:
    train, heldout = data
    env = dict(os.environ, HADPSGD_TIMEOUT="300")
    cmd = [sys.executable, "-m", "lab.sweep", "--sweep-dir", str(sweep_dir),
           "--algos", "ssgd", "--global-batch", "8,16", "--learners", "2", "--epochs", "1",
           "--preset", "tiny", "--timeout", "600", "--",
           "--train", str(train), "--heldout", str(heldout), "--max-steps", "2",
           "--log-every", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def _summary(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith('{"benchmark": "sweep"')]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


def test_two_cell_sweep_plots_and_resume(tmp_path, tiny_data):
    sweep_dir = tmp_path / "sweep"
    res = _sweep(sweep_dir, tiny_data)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert _summary(res.stdout)["ran"] == 2

    rows = [json.loads(ln) for ln in (sweep_dir / "results.jsonl").read_text().splitlines()]
    assert sorted(r["global_batch"] for r in rows) == [8, 16]
    for r in rows:
        assert r["status"] == "ok" and r["exit_code"] == 0, r
        assert r["batch_size"] == r["global_batch"] // 2 and r["learners"] == 2
        assert math.isfinite(r["final_heldout_loss"]) and 0 <= r["final_heldout_acc"] <= 1
        assert r["heldout_loss_curve"] and all(math.isfinite(x) for x in r["heldout_loss_curve"])
        assert r["mean_frames_per_s"] > 0 and r["wall_s"] > 0
        assert (sweep_dir / "cells" / r["id"] / "metrics.jsonl").is_file()
    assert (sweep_dir / "results.csv").read_text().count("\n") == 3  # header + 2 cells

    plots = subprocess.run([sys.executable, "-m", "lab.plots", str(sweep_dir)],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert plots.returncode == 0, plots.stderr
    for name in ("loss_vs_epoch", "error_vs_batch", "scaling"):
        png = sweep_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    again = _sweep(sweep_dir, tiny_data)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    summary = _summary(again.stdout)
    assert (summary["ran"], summary["skipped"], summary["finished"]) == (0, 2, 2)
    assert again.stdout.count("skipped (ok in results.jsonl)") == 2
    assert len((sweep_dir / "results.jsonl").read_text().splitlines()) == 2
