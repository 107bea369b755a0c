"""Straggler tolerance through ``python -m hadpsgd.run``: one learner k times slower.

SSGD, ADPSGD and H-ADPSGD. Usage::

    python benchmarks/straggler.py [-n 4] [--slowdowns 1 2 3] [--epochs 3] [--json out.json]

Every learner gets an emulated device step (``HADPSGD_EMULATE_STEP``: a fixed wait before each
training forward, so ranks sharing a few cores do not slow each other down) and learner 1 is
``k`` times slower. The time is the training time between the first and the last held-out
evaluation in the run's ``metrics.jsonl`` (start-up excluded), on the user's path: the main
command with its loop, control points, data and checkpoints. The ratio is SSGD's time over the
algorithm's at the same k, next to the ideal ``(G - 1 + 1/k) / G * k`` for G independent
super-learners (G = N for flat ADPSGD; the straggler slows its whole super-learner): only the
straggler's own missing work is lost.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common.launch import bench_env, emit, run_job, worker_command
from hadpsgd.exit_codes import EXIT_OK, describe

ALGOS = {
    "ssgd": ["--algo", "ssgd"],
    "adpsgd": ["--algo", "adpsgd", "--super-learner-size", "1"],
    "h-adpsgd": ["--algo", "adpsgd", "--super-learner-size", "2"],
}
"""The configurations measured (H-ADPSGD: super-learners of 2 learners)."""
GROUP = {"ssgd": None, "adpsgd": 1, "h-adpsgd": 2}
"""Learners per independently paced super-learner (SSGD: all in lock step)."""


def ideal(groups: int, k: float) -> float:
    """Speed-up over SSGD when only the straggler's super-learner goes k times slower."""
    return (groups - 1 + 1 / k) / groups * k


def train_seconds(metrics: Path) -> float:
    """Seconds between the first and the last held-out evaluation after a training epoch.

    The evaluation before training (step 0) is left out: the span starts after the first
    epoch, which holds the start-up's warm-up, as it did before that evaluation existed.
    """
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()
               if '"kind": "eval"' in ln]
    times = [r["time"] for r in records if r.get("step") != 0]
    if len(times) < 2:
        raise SystemExit(f"{metrics}: fewer than two evaluations; use --epochs >= 2")
    return times[-1] - times[0]


def measure(algo: str, k: float, a: argparse.Namespace, out: Path) -> float:
    """Training seconds of ``algo`` on ``a.nprocs`` ranks with learner 1 ``k`` times slower."""
    run_dir = out / f"{algo}-k{k:g}"
    args = [*ALGOS[algo], "--preset", a.preset, "--epochs", str(a.epochs), "--batch-size",
            str(a.batch_size), "--no-progress", "--out-dir", str(run_dir), "--overwrite",
            *a.extra]
    spec = f"ms={a.step_ms:g}" + (f",rank=1,factor={k:g}" if k != 1 else "")
    cmd = worker_command("hadpsgd.run", args, a.nprocs)
    done = run_job(cmd, timeout=a.timeout,
                   env=bench_env(a.nprocs, {"HADPSGD_EMULATE_STEP": spec}))
    if done.returncode != EXIT_OK:
        raise SystemExit(f"run failed ({describe(done.returncode)}): {' '.join(cmd)}\n"
                         f"{done.stdout}\n{done.stderr}")
    return train_seconds(run_dir / "metrics.jsonl")


def main(argv: list[str] | None = None) -> int:
    """Measure every algorithm at every slowdown; print the table and the JSON record."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nprocs", type=int, default=4)
    p.add_argument("--slowdowns", nargs="+", type=float, default=[1, 2, 3])
    p.add_argument("--algos", nargs="+", choices=list(ALGOS), default=list(ALGOS))
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (>= 2)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=40.0,
                   help="emulated device step of a normal learner (ms)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--json", type=Path)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further hadpsgd.run flags (last on the line)")
    a = p.parse_args(argv)
    if "ssgd" not in a.algos:
        a.algos.insert(0, "ssgd")  # the baseline of every ratio
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hadpsgd-straggler-") as tmp:
        for k in a.slowdowns:
            secs = {algo: measure(algo, k, a, Path(tmp)) for algo in a.algos}
            for algo, s in secs.items():
                group = GROUP[algo]
                rows.append({"algo": algo, "slowdown": k, "train_s": round(s, 3),
                             "speedup_vs_ssgd": round(secs["ssgd"] / s, 3),
                             "ideal": round(ideal(a.nprocs // group, k), 3) if group else 1.0})
    print(f"{'algo':>9} {'k':>4} {'train s':>9} {'vs SSGD':>8} {'ideal':>6}")
    for r in rows:
        print(f"{r['algo']:>9} {r['slowdown']:>4g} {r['train_s']:>9.2f} "
              f"{r['speedup_vs_ssgd']:>8.2f} {r['ideal']:>6.2f}")
    emit({"benchmark": "straggler", "path": "python -m hadpsgd.run",
          "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "ranks": a.nprocs, "preset": a.preset,
          "epochs": a.epochs, "batch_size": a.batch_size, "step_ms": a.step_ms, "rows": rows},
         a.json)
    return 0
