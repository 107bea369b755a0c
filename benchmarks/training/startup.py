"""How long a short run waits before its first step, against ``import torch`` alone.

A short job is mostly start-up: the interpreter and its imports, MPI, the data checks, the
model's broadcast, the algorithm, the first evaluation. This measures the path a user takes,
``python -m hadpsgd.launch -n N -- --preset tiny --epochs 1``, from the launch to its first
trained step (the first ``train`` record's clock time under ``--log-every 1``), with the
phases its start-up line reports, against a baseline run in the same invocation: N processes
running ``python -c 'import torch'`` at once (what no torch program can start below),
alternated round by round. The ratio is the run's time to its first step over the baseline's
wall time, per round, and their median.

Usage::

    python -m benchmarks.training.startup [--nprocs 4] [--rounds 3] [--json startup.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import ROOT, bench_env

STARTUP = re.compile(r"start-up ([\d.]+) s on the slowest rank \(\d+: (.*?)\);")


def import_torch(nprocs: int) -> float:
    """Wall seconds for ``nprocs`` processes importing torch at once."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"], env=bench_env(nprocs))
             for _ in range(nprocs)]
    for proc in procs:
        if proc.wait(timeout=300) != 0:
            raise SystemExit("python -c 'import torch' failed")
    return time.monotonic() - start


def first_step(nprocs: int, out: Path) -> dict[str, Any]:
    """One short run through the launcher: seconds to its first step, and its phases.

    On the embedded default set (no ``--train``: generated once and cached), as the
    README's first command.
    """
    cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(nprocs), "--",
           "--preset", "tiny", "--epochs", "1",
           "--log-every", "1", "--no-progress", "--out-dir", str(out)]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=bench_env(nprocs))
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    first = next((r for r in records if r["kind"] == "train"), None)
    said = STARTUP.search(done.stdout + done.stderr)
    if done.returncode != 0 or first is None or said is None:
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    # "python and imports 1.2, MPI and communicators 1.1, data, model and algorithm 0.1"
    phases = {name: float(sec) for name, sec in re.findall(r"(.+?) ([\d.]+)(?:, |$)", said[2])}
    return {"to_first_step_s": round(first["time"] - start, 2),
            "startup_s": float(said[1]), "phases": phases}


def main(argv: Sequence[str] | None = None) -> int:
    """Alternate the baseline and the run; print the table; write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training.startup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hadpsgd-startup-") as tmp:
        first_step(opts.nprocs, Path(tmp) / "warm")  # the cached set, page cache, bytecode
        for i in range(opts.rounds):
            base = import_torch(opts.nprocs)
            run = first_step(opts.nprocs, Path(tmp) / f"run-{i}")
            rounds.append({"import_torch_s": round(base, 2), **run,
                           "ratio": round(run["to_first_step_s"] / base, 2)})
            print(json.dumps(rounds[-1]), flush=True)
    result = {"nprocs": opts.nprocs, "rounds": rounds,
              "median_ratio": statistics.median(r["ratio"] for r in rounds),
              "median_to_first_step_s": statistics.median(r["to_first_step_s"]
                                                          for r in rounds)}
    rows = ["| round | N x import torch | launch -> first step | start-up line | phases | "
            "ratio |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
        rows.append(f"| {i} | {r['import_torch_s']:.2f} s | {r['to_first_step_s']:.2f} s | "
                    f"{r['startup_s']:.1f} s | {phases} | {r['ratio']:.2f} |")
    print("\n".join(rows) + f"\n\nmedian ratio {result['median_ratio']:.2f} ({opts.nprocs} "
          "processes)")
    if opts.json is not None:
        opts.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
