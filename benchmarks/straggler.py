"""Straggler tolerance: aggregate frames/s of ADPSGD vs SSGD with one rank k times slower.

Usage::

    python benchmarks/straggler.py [-n 4] [--slowdowns 1 2 4] [--json out.json]

SSGD runs in lock step, so every rank goes at the straggler's pace; ADPSGD's fast learners
keep their own pace (gossip never blocks compute). The ratio is ADPSGD / SSGD at each k.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hadpsgd.launch import launch_env, mpirun_command  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_straggler_worker.py")


def measure(algo: str, k: float, n: int, extra: list[str], timeout: float) -> dict:
    cmd = mpirun_command(n, [], module="x")[:-3] + [sys.executable, WORKER, "--algo", algo,
                                                   "--slowdown", str(k), *extra]
    env = launch_env(nprocs=n)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])


def main(argv: list[str] | None = None) -> int:
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
    print(json.dumps(record))
    if a.json:
        a.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
