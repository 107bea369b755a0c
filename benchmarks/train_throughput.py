"""Training throughput of hadpsgd SSGD against a plain single-process PyTorch loop.

For each preset (``small``, ``swb``) and rank count (1, 2) it runs the same model and per-rank
batch on random in-memory data (so only compute and communication are measured), and reports
frames/s with the ratio to the plain loop measured in the same run. Usage::

    python benchmarks/train_throughput.py [--presets small swb] [--ranks 1 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import emit, run_worker  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_throughput_worker.py")
# Per-rank batch and classes: the paper's 128 x 21 frames and 32,000 classes for swb would
# take minutes per step on a 2-core CPU, so the CPU defaults are smaller (flags override).
DEFAULTS = {"small": (32, 64), "swb": (8, 32000)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["small", "swb"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batch", type=int, help="per-rank batch (default: per preset)")
    p.add_argument("--classes", type=int, help="output classes (default: per preset)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the JSON record here")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)

    rows = []
    for preset in a.presets:
        batch, classes = DEFAULTS.get(preset, (16, 64))
        batch, classes = a.batch or batch, a.classes or classes
        common = ["--preset", preset, "--batch", str(batch), "--classes", str(classes),
                  "--steps", str(a.steps)]
        base = run_worker(WORKER, ["--mode", "plain", *common], None, a.timeout)[-1]
        rows.append({**base, "ratio_vs_plain": 1.0})
        for n in a.ranks:
            res = run_worker(WORKER, ["--mode", "ssgd", *common], n, a.timeout)[-1]
            res["ratio_vs_plain"] = res["frames_per_s"] / base["frames_per_s"]
            rows.append(res)

    print(f"{'preset':<7} {'mode':<6} {'ranks':>5} {'thr/rank':>8} {'batch/rank':>10} "
          f"{'s/step':>8} {'frames/s':>10} {'vs plain':>8}")
    for r in rows:
        print(f"{r['preset']:<7} {r['mode']:<6} {r['ranks']:>5} {r['threads_per_rank']:>8} "
              f"{r['batch_per_rank']:>10} {r['sec_per_step']:>8.3f} {r['frames_per_s']:>10.0f} "
              f"{r['ratio_vs_plain']:>8.2f}")
    record = {"benchmark": "train_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cpus": os.cpu_count(), "rows": rows}
    emit(record, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
