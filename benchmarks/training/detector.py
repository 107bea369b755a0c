"""What Open MPI's heartbeat detector costs a training step (``--on-failure continue``).

``python -m hadpsgd.launch`` turns the detector on under ``--on-failure continue``
(``mpi_ft_detector`` with its own thread, a heartbeat every 0.5 s, a process declared dead
after 2 s without one), so that a frozen learner is dropped in seconds instead of at
``HADPSGD_TIMEOUT``. This measures the price on the step: the same SSGD run through
``python -m hadpsgd.launch`` with the detector and without it
(``OMPI_MCA_mpi_ft_detector=false``, which the launcher keeps), both under
``--on-failure continue``, alternated pair by pair in one invocation so that a machine's
drift falls on both alike. A run's speed is the median of its steady ``train`` windows
(:mod:`benchmarks.training.steady`); the ratio is the detector's seconds per step over the
baseline's, per pair, and their median. Usage::

    python -m benchmarks.training.detector [--nprocs 4] [--pairs 3] [--max-steps 300]
        [--preset tiny] [--json detector.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import ROOT, bench_env
from benchmarks.training.steady import read_steady

MODES = {"detector": {}, "no detector": {"OMPI_MCA_mpi_ft_detector": "false"}}
"""The launch environment of each mode: the launcher's default, and the detector off."""


def run_once(data: tuple[Path, Path], out: Path, mode: str, nprocs: int, args: Sequence[str],
             timeout: float) -> dict[str, Any]:
    """One run of ``python -m hadpsgd.launch`` in ``mode``; its steady speed.

    Raises:
        SystemExit: If the run fails or has no steady window, with its output.
    """
    cmd = [sys.executable, "-m", "hadpsgd.launch", "-n", str(nprocs), "--",
           "--train", str(data[0]), "--heldout", str(data[1]), "--out-dir", str(out),
           "--no-progress", "--on-failure", "continue", *args]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=bench_env(nprocs, MODES[mode]))
    wall = time.monotonic() - start
    steady = read_steady(out / "metrics.jsonl")
    if done.returncode != 0 or steady is None or steady.sec_per_step is None:
        raise SystemExit(f"{mode}: {' '.join(cmd)} failed (exit {done.returncode}) or has "
                         f"no steady window\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    flags = done.stdout.splitlines()[0] if done.stdout else ""
    if ("mpi_ft_detector" in flags) != (mode == "detector"):
        raise SystemExit(f"{mode}: the launcher's command does not match the mode: {flags}")
    return {"mode": mode, "sec_per_step": steady.sec_per_step,
            "frames_per_s": steady.frames_per_s, "windows": steady.windows,
            "wall_s": round(wall, 2)}


def measure(nprocs: int, pairs: int, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """Alternate ``pairs`` runs of each mode (the order swapped every pair); the figures."""
    from hadpsgd.data.synth import SynthSpec, generate

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hadpsgd-detector-") as tmp:
        spec = SynthSpec(feat_dim=260, num_classes=12, train_utts=600, heldout_utts=12,
                         min_len=60, max_len=120, seed=3)
        data = generate(Path(tmp) / "data", spec)
        for pair in range(pairs):
            order = list(MODES) if pair % 2 == 0 else list(reversed(MODES))
            for mode in order:
                out = Path(tmp) / f"run-{pair}-{mode.replace(' ', '-')}"
                runs.append({"pair": pair, **run_once(data, out, mode, nprocs, args, timeout)})
                print(json.dumps(runs[-1]), flush=True)
    ratios = []
    for pair in range(pairs):
        by_mode = {r["mode"]: r for r in runs if r["pair"] == pair}
        ratios.append(by_mode["detector"]["sec_per_step"] / by_mode["no detector"]["sec_per_step"])
    summary = {mode: statistics.median(r["sec_per_step"] for r in runs if r["mode"] == mode)
               for mode in MODES}
    return {"nprocs": nprocs, "pairs": pairs, "args": list(args), "runs": runs,
            "median_sec_per_step": summary, "ratios": ratios,
            "median_ratio": statistics.median(ratios)}


def table(result: dict[str, Any]) -> str:
    """A markdown table of the medians and the ratio (detector over no detector)."""
    rows = ["| mode | sec/step (median of runs) | frames/s (median) | ratio |",
            "|---|---|---|---|"]
    base = result["median_sec_per_step"]["no detector"]
    for mode in MODES:
        fps = statistics.median(r["frames_per_s"] for r in result["runs"] if r["mode"] == mode)
        sec = result["median_sec_per_step"][mode]
        rows.append(f"| {mode} | {sec * 1e3:.2f} ms | {fps:,.0f} | {sec / base:.3f} |")
    rows.append(f"\nper-pair ratios: {', '.join(f'{x:.3f}' for x in result['ratios'])}; "
                f"median {result['median_ratio']:.3f} ({result['nprocs']} ranks, "
                f"{result['pairs']} pairs)")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pairs, print the table, write the JSON; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training.detector",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=4, help="ranks of each run (default 4)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="runs of each mode, alternated (default 3)")
    parser.add_argument("--max-steps", type=int, default=300, help="steps of a run (300)")
    parser.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    parser.add_argument("--batch-size", type=int, default=4, help="per learner (default 4)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    opts = parser.parse_args(argv)
    args = ["--preset", opts.preset, "--algo", "ssgd", "--batch-size", str(opts.batch_size),
            "--max-steps", str(opts.max_steps), "--log-every", "20", "--checkpoint-every",
            "0", "--epochs", "100"]
    result = measure(opts.nprocs, opts.pairs, args, opts.timeout)
    print(table(result))
    if opts.json is not None:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
