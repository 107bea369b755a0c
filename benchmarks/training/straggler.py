"""Straggler tolerance: aggregate frames/s of ADPSGD vs SSGD with one rank k times slower.

Usage::

    python benchmarks/straggler.py [-n 4] [--slowdowns 1 2 4] [--json out.json]

SSGD runs in lock step, so every rank goes at the straggler's pace; ADPSGD's fast learners
keep their own pace (gossip never blocks compute). The ratio is ADPSGD / SSGD at each k.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit, run_worker

WORKER = "benchmarks.training.straggler_worker"
"""The module every rank of a measurement runs."""


def measure(algo: str, k: float, n: int, extra: list[str], timeout: float) -> dict[str, Any]:
    """Aggregate frames/s of ``algo`` on ``n`` ranks with rank 0 ``k`` times slower."""
    return run_worker(WORKER, ["--algo", algo, "--slowdown", str(k), *extra], n, timeout)[-1]


def main(argv: list[str] | None = None) -> int:
    """Measure SSGD and ADPSGD at every slowdown; print the table and the JSON record."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nprocs", type=int, default=4)
    p.add_argument("--slowdowns", nargs="+", type=float, default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--json", type=Path)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    extra = ["--steps", str(a.steps), "--preset", a.preset]
    rows = []
    for k in a.slowdowns:
        s = measure("ssgd", k, a.nprocs, extra, a.timeout)
        d = measure("adpsgd", k, a.nprocs, extra, a.timeout)
        rows.append({"slowdown": k, "ssgd_frames_per_s": s["frames_per_s"],
                     "adpsgd_frames_per_s": d["frames_per_s"],
                     "ratio_adpsgd_vs_ssgd": d["frames_per_s"] / s["frames_per_s"]})
    print(f"{'k':>4} {'SSGD frames/s':>14} {'ADPSGD frames/s':>16} {'ADPSGD/SSGD':>12}")
    for r in rows:
        print(f"{r['slowdown']:>4g} {r['ssgd_frames_per_s']:>14.0f} "
              f"{r['adpsgd_frames_per_s']:>16.0f} {r['ratio_adpsgd_vs_ssgd']:>12.2f}")
    record = {"benchmark": "straggler", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "ranks": a.nprocs, "preset": a.preset, "rows": rows}
    emit(record, a.json)
    return 0
