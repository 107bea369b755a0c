"""One-GPU grid of ``swb``: hadpsgd's steady frames/s next to a plain PyTorch loop, per cell.

For batch 16 / 64 / 128 x bf16 / fp32 / TF32 (and fp16 if asked) x LSTM layout stacked /
per-layer:

- **hadpsgd**: ``python -m hadpsgd.run --device cuda --algo ssgd`` (one rank, under
  ``mpirun -np 1``), the user's command, on a synthetic set with the preset's 32,000 classes;
  its frames/s is the median of the steady ``metrics.jsonl`` windows (a window every
  ``--log-every`` steps, the first, its warm-up, left out: :mod:`.steady`);
- **plain** (the anchor, same run): the same ``hadpsgd.models`` BLSTM, batch, chunk length,
  autocast and TF32 in a plain loop with ``torch.optim.SGD`` and cross-entropy on random data
  already on the GPU (:mod:`.gpu_grid_worker`), timed in the same windows;
- the ratio hadpsgd / plain per cell, and the targets: bf16 at batch 128 at least 3x the seed
  paper's V100 (15.8k frames/s), hadpsgd at least 0.95x the plain loop;
- a ``torch.profiler`` chrome trace of two steady steps of one cell (``--profile-cell``,
  default ``128/bf16/stacked``) through ``hadpsgd.run`` (:mod:`.gpu_grid_profile`) and of the
  plain loop, with their top kernels and the GPU's busy share;
- ``python -m hadpsgd.forward --device cuda`` against ``--device cpu`` on a small checkpoint
  it trains first: the time of each and the largest difference of their outputs.

The default's 18 cells (fp16 only with ``--precision fp16``) need ~380 s on one H200
(``hadpsgd.run``'s start-up, 10-15 s a cell, dominates; ``--dry-run`` prints the plan);
``--budget`` (480 s) bounds the whole, the profile and the forward check run before the
cells, and the cells run largest batch and bf16 first, so that what the budget leaves out
(the last batch-16 cells) is the least telling.
Writes a Markdown report and the JSON record; exit 0 when every cell was measured, 1 when one
failed or was left out, 2 without CUDA. Usage::

    python -m benchmarks.training.gpu_grid [--report gpu-grid-report.md]
    python -m benchmarks.training.gpu_grid --batch 128 --precision bf16 fp32 --layout stacked
    bash scripts/gpu_check.sh --grid [REPORT.md] [flags above]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import bench_env, emit, worker_command
from benchmarks.training import gpu_grid_report as rep
from benchmarks.training.steady import read_steady

PLAIN = "benchmarks.training.gpu_grid_worker"
PROFILE = "benchmarks.training.gpu_grid_profile"
CHUNKS_PER_UTT = 9
"""Chunks of 21 frames in a synthetic utterance (100-300 frames: ~10; fewer is the safe side)."""
PROFILE_SKIP = 10
"""Steps ``hadpsgd.run`` takes before the two it profiles."""


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", type=Path, default=Path("gpu-grid-report.md"))
    p.add_argument("--json", type=Path, help="the JSON record (default: the report's .json)")
    p.add_argument("--work", type=Path, help="scratch directory (default: a temp dir)")
    p.add_argument("--batch", type=int, nargs="+", default=list(rep.BATCHES))
    p.add_argument("--precision", nargs="+", choices=rep.PRECISIONS,
                   default=list(rep.DEFAULT_PRECISIONS))
    p.add_argument("--layout", nargs="+", choices=rep.LAYOUTS, default=list(rep.LAYOUTS))
    p.add_argument("--steps", type=int, default=40, help="steps of each hadpsgd.run")
    p.add_argument("--log-every", type=int, default=8, help="steps per timed window")
    p.add_argument("--preset", default="swb")
    p.add_argument("--classes", type=int, default=32000)
    p.add_argument("--run-flags", default="",
                   help="more flags for every hadpsgd.run of the grid, e.g. '--num-workers 0' "
                        "(the loader in the training process, the default before CUDA read "
                        "ahead in 2 workers)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each cell's estimate, the total and the budget, run nothing "
                        "(no GPU needed); exit 1 if the grid does not fit the budget")
    p.add_argument("--budget", type=float, default=rep.DEFAULT_BUDGET_S,
                   help="seconds the grid may take; what does not fit is reported, and fails")
    p.add_argument("--cell-timeout", type=float, default=180.0)
    p.add_argument("--profile-cell", default="128/bf16/stacked",
                   help="batch/precision/layout to profile, or 'none'")
    p.add_argument("--no-forward", action="store_true", help="skip hadpsgd.forward's check")
    p.add_argument("--forward-preset", default="small")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run of the plumbing (its figures mean nothing)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.steps < 2 * a.log_every:
        p.error("--steps must hold at least two windows of --log-every (one is warm-up)")
    if a.profile_cell != "none":
        try:
            rep.parse_key(a.profile_cell)
        except ValueError as err:
            p.error(str(err))
    return a


class Grid:
    """Runs the measurements of one grid under one budget."""

    def __init__(self, a: argparse.Namespace, work: Path) -> None:
        self.a, self.work = a, work
        self.t0 = time.monotonic()
        self.logs: dict[str, str] = {}  # what a failed command printed, by its name

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.a.budget - (time.monotonic() - self.t0)

    def sh(self, name: str, cmd: list[str], limit: float, nprocs: int | None
           ) -> tuple[int, str]:
        """Run ``cmd`` (exit 124 at its limit or the budget's end); its code and output."""
        limit = max(1.0, min(limit, self.left()))
        env = bench_env(nprocs, {"HADPSGD_TIMEOUT": "120", "PYTHONUNBUFFERED": "1"})
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            code, out = res.returncode, res.stdout + res.stderr
        except subprocess.TimeoutExpired as err:
            raw = (err.stdout or b"") + (err.stderr or b"")
            out = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            code, out = 124, out + f"\n[gpu_grid] {name}: stopped after {limit:.0f} s"
        if code != 0:
            self.logs[name] = "\n".join(out.splitlines()[-40:])
        return code, out

    def data(self, classes: int, train_utts: int, heldout_utts: int, name: str
             ) -> tuple[Path, Path]:
        """A synthetic train / held-out pair (made once per work directory)."""
        from hadpsgd.data.synth import SynthSpec, generate

        out = self.work / name
        if (out / "train.h5").exists() and (out / "heldout.h5").exists():
            return out / "train.h5", out / "heldout.h5"
        out.mkdir(parents=True, exist_ok=True)
        return generate(out, SynthSpec(num_classes=classes, train_utts=train_utts,
                                       heldout_utts=heldout_utts, seed=0))

    def run_args(self, data: tuple[Path, Path], out: Path, steps: int) -> list[str]:
        """``hadpsgd.run``'s flags common to every cell."""
        a = self.a
        return ["--device", a.device, "--preset", a.preset, "--algo", "ssgd", "--train",
                str(data[0]), "--heldout", str(data[1]), "--max-steps", str(steps),
                "--log-every", str(a.log_every), "--lr", "0.01", "--no-progress",
                "--out-dir", str(out), "--overwrite", *shlex.split(a.run_flags)]

    def plain(self, cells: list[rep.Cell], trace: Path) -> dict[str, dict[str, Any]]:
        """The plain loop of every cell, in one process; its JSON lines by cell key."""
        a = self.a
        args = ["--cells", ",".join(c.key for c in cells), "--preset", a.preset, "--classes",
                str(a.classes), "--window", str(a.log_every), "--windows",
                str(a.steps // a.log_every - 1), "--device", a.device,
                "--profile-cell", a.profile_cell, "--profile-out", str(trace)]
        _, out = self.sh("plain loop", worker_command(PLAIN, args, None),
                         30 + 20 * len(cells), None)
        found = {}
        for line in out.splitlines():
            try:
                rec = json.loads(line) if line.startswith('{"cell"') else None
            except ValueError:
                rec = None  # the last line of a worker stopped mid-write
            if rec is not None:
                found[rec["cell"]] = rec
        return found

    def hadpsgd(self, cell: rep.Cell, data: tuple[Path, Path]) -> dict[str, Any]:
        """One cell through ``hadpsgd.run``: its steady speed, or why there is none."""
        out = self.work / "cells" / cell.key.replace("/", "-")
        start = time.monotonic()
        code, text = self.sh(cell.key, worker_command(
            "hadpsgd.run", [*self.run_args(data, out, self.a.steps), *cell.run_args()], 1),
            self.a.cell_timeout, 1)
        result: dict[str, Any] = {"seconds": round(time.monotonic() - start, 1), "exit": code}
        m = re.search(r"\[hadpsgd\] start-up ([0-9.]+) s", text)
        result["startup_s"] = float(m.group(1)) if m else None
        if "contiguous chunk" in text:
            result["warning"] = "cuDNN copied the LSTM weights (not in one contiguous chunk)"
        speed = read_steady(out / "metrics.jsonl")
        if code == 0 and speed is not None and speed.frames_per_s:
            result.update(frames_per_s=speed.frames_per_s, sec_per_step=speed.sec_per_step,
                          windows=speed.windows, warmup_windows=speed.warmup)
        return result

    def profile(self, cell: rep.Cell, data: tuple[Path, Path], trace: Path
                ) -> dict[str, Any] | None:
        """Two steady steps of ``cell`` through ``hadpsgd.run`` under the profiler."""
        out = self.work / "profile-run"
        args = ["--trace", str(trace), "--skip", str(PROFILE_SKIP), "--",
                *self.run_args(data, out, PROFILE_SKIP + 4), *cell.run_args()]
        code, _ = self.sh("profile", worker_command(PROFILE, args, 1), self.a.cell_timeout, 1)
        return summary_of(trace) if code == 0 else None

    def forward(self, devices: tuple[str, str] = ("cuda", "cpu")) -> dict[str, Any]:
        """``hadpsgd.forward`` on CUDA and on CPU from one small checkpoint: time, difference."""
        data = self.data(64, 60, 100, "forward-data")
        model = self.work / "forward-model"
        args = [*self.run_args(data, model, 10), "--batch-size", "16"]
        args[args.index("--preset") + 1] = self.a.forward_preset
        code, _ = self.sh("forward: training", worker_command("hadpsgd.run", args, 1), 120, 1)
        result: dict[str, Any] = {"preset": self.a.forward_preset, "precision": "fp32"}
        if code != 0:
            return {**result, "error": "training the checkpoint failed (see the log)"}
        outputs = [self.work / f"forward-{i}-{dev}.h5" for i, dev in enumerate(devices)]
        for dev, output in zip(devices, outputs, strict=True):
            start = time.monotonic()
            code, text = self.sh(f"forward: {dev}", worker_command("hadpsgd.forward", [
                str(model), "--features", str(data[1]), "--out",
                str(output), "--device", dev, "--priors", "none",
                "--precision", "fp32", "--no-progress", "--overwrite"], 1), 180, 1)
            m = re.search(r"wrote [\d,]+ utterances, ([\d,]+) frames .* in ([0-9.]+) s", text)
            result[dev] = {"exit": code, "wall_s": round(time.monotonic() - start, 2),
                           "frames": int(m.group(1).replace(",", "")) if m else None,
                           "forward_s": float(m.group(2)) if m else None}
            if code != 0:
                return {**result, "error": f"hadpsgd.forward --device {dev} failed"}
        return {**result, **compare_outputs(*outputs)}


def summary_of(trace: Path) -> dict[str, Any] | None:
    """:func:`rep.summarise_trace` of a chrome trace file, or ``None`` if it is missing."""
    if not trace.exists():
        return None
    return rep.summarise_trace(json.loads(trace.read_text()))


def compare_outputs(a: Path, b: Path) -> dict[str, Any]:
    """Largest and mean absolute difference of two ``hadpsgd.forward`` HDF5 outputs."""
    import h5py
    import numpy as np

    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        x, y = np.asarray(fa["loglikes"]), np.asarray(fb["loglikes"])
        same_utts = bool(np.array_equal(fa["offsets"][()], fb["offsets"][()]))
    if x.shape != y.shape:
        return {"error": f"shapes differ: {x.shape} vs {y.shape}"}
    diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
    return {"frames": int(x.shape[0]), "classes": int(x.shape[1]), "same_offsets": same_utts,
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "argmax_agree": float((x.argmax(1) == y.argmax(1)).mean())}


def device_meta(device: str) -> dict[str, Any]:
    """The GPU, torch's versions and torch's TF32 defaults (before any cell sets them)."""
    import torch

    cuda = device == "cuda"
    return {"type": device, "name": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "tf32_matmul_default": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn_default": torch.backends.cudnn.allow_tf32}


def status_of(h: dict[str, Any] | None, p: dict[str, Any] | None) -> str:
    """``ok``, or what is missing from a cell (hadpsgd's exit, no steady window, plain's error)."""
    why = []
    if h is None or h.get("exit") != 0:
        why.append(f"hadpsgd exit {(h or {}).get('exit')}")
    elif not h.get("frames_per_s"):
        why.append("hadpsgd: no steady window")
    if p is None:
        why.append("plain: not measured")
    elif p.get("error"):
        why.append(f"plain: {p['error'][:80]}")
    return "; ".join(why) or "ok"


def run_profile(grid: Grid, cell: rep.Cell | None, data: tuple[Path, Path],
                traces: dict[str, Path]) -> dict[str, Any]:
    """The profile section of the record: hadpsgd's (run now) and the plain loop's."""
    if cell is None:
        return {}
    summary = grid.profile(cell, data, traces["hadpsgd"]) if grid.left() >= 40 else None
    return {"cell": cell.key, "skip": PROFILE_SKIP,
            "hadpsgd": {"trace": str(traces["hadpsgd"]), "summary": summary},
            "plain": {"trace": str(traces["plain"]), "summary": summary_of(traces["plain"])}}


def run_cells(grid: Grid, cells: list[rep.Cell], plain: dict[str, dict[str, Any]],
              data: tuple[Path, Path]) -> list[dict[str, Any]]:
    """Run ``hadpsgd.run`` on every cell the budget allows, each row beside its plain loop."""
    rows, need = [], 25.0
    for cell in cells:
        p = plain.get(cell.key)
        if grid.left() < need:
            rows.append(rep.row(cell, None, p, "over budget"))
            continue
        h = grid.hadpsgd(cell, data)
        need = max(need, h["seconds"])  # the next cell is likely no quicker
        rows.append(rep.row(cell, h, None if p is None or p.get("error") else p,
                            status_of(h, p)))
        r = rows[-1]
        print(f"[gpu_grid] {cell.key}: hadpsgd {r['hadpsgd'].get('frames_per_s') or 0:,.0f}, "
              f"plain {(r['plain'] or {}).get('frames_per_s') or 0:,.0f} frames/s "
              f"({h['seconds']:.0f} s) {r['status']}", flush=True)
    return rows


def dry_run(a: argparse.Namespace) -> int:
    """Print the plan: each cell's estimate (H100 / H200 times), the total, the budget.

    Returns:
        0 when the grid fits its budget, 1 when the budget would leave cells out.
    """
    cells = rep.grid(a.batch, a.precision, a.layout)
    fixed = a.profile_cell != "none" or not a.no_forward
    print(f"[gpu_grid] dry run: {len(cells)} cells, budget {a.budget:.0f} s")
    if fixed:
        print(f"  {rep.FIXED_S:5.0f} s  the synthetic set, the plain loop's start, the profile "
              f"of {a.profile_cell}, the forward check")
    for cell in cells:
        print(f"  {rep.CELL_S:5.0f} s  {cell.key}")
    total = rep.estimate(len(cells), fixed)
    fits = total <= a.budget
    print(f"[gpu_grid] total ~{total:.0f} s of {a.budget:.0f} s: "
          + ("fits" if fits else "does not fit (the last cells would be left out: a failure); "
             "give fewer cells or --budget"))
    return 0 if fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the grid, write the report and the JSON record; the exit code."""
    a = parse_args(argv)
    if a.dry_run:
        return dry_run(a)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_grid: needs a CUDA GPU, and torch {torch.__version__} sees none; run it on "
              "a GPU machine (bash scripts/gpu_check.sh --grid), or add --device cpu for a "
              "dry run of the plumbing", file=sys.stderr)
        return 2
    a.report = a.report.resolve()  # the traces go beside it, whatever the ranks' directory
    work = a.work or Path(tempfile.mkdtemp(prefix="hadpsgd-gpu-grid-"))
    work.mkdir(parents=True, exist_ok=True)
    grid = Grid(a, work)
    cells = rep.grid(a.batch, a.precision, a.layout)
    pcell = None if a.profile_cell == "none" else rep.parse_key(a.profile_cell)
    biggest = max([c.batch for c in cells] + ([pcell.batch] if pcell else []))
    utts = max(a.steps, PROFILE_SKIP + 4) * biggest // CHUNKS_PER_UTT + 20
    print(f"[gpu_grid] {len(cells)} cells, budget {a.budget:.0f} s; a synthetic set of {utts} "
          f"utterances in {work}", flush=True)
    data = grid.data(a.classes, utts, 20, "data")
    # Beside the report: the traces are what one opens after the run.
    traces = {side: a.report.with_name(f"{a.report.stem}-trace-{side}.json")
              for side in ("hadpsgd", "plain")}
    for trace in traces.values():
        trace.unlink(missing_ok=True)  # an earlier run's trace must not pass for this one's
    extra = [pcell] if pcell is not None and pcell not in cells else []
    plain = grid.plain(cells + extra, traces["plain"])
    # The profile and the forward check before the cells: the budget cuts the last cells
    # (batch 16), which tell less than either.
    profile = run_profile(grid, pcell, data, traces)
    forward: dict[str, Any] | None = None
    if not a.no_forward:
        forward = ({"skipped": "needs CUDA (--device cpu is a dry run)"} if a.device == "cpu"
                   else grid.forward() if grid.left() >= 60
                   else {"skipped": "over budget", "error": "over budget"})
    rows = run_cells(grid, cells, plain, data)
    meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": device_meta(a.device),
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "total_s": time.monotonic() - grid.t0, "work": str(work)}
    rec = rep.record(rows, meta, {"profile": profile, "forward": forward, "logs": grid.logs})
    text = rep.markdown(rec)
    a.report.write_text(text)
    print("\n".join(rep.table(rows)), flush=True)
    print("\n".join(rep.target_table(rec["targets"])), flush=True)
    emit(rec, a.json or a.report.with_suffix(".json"))
    print(f"[gpu_grid] report: {a.report}", file=sys.stderr, flush=True)
    bad = [r for r in rows if r["status"] != "ok"]
    failed_parts = ((profile and not (profile["hadpsgd"]["summary"]
                                      and profile["plain"]["summary"]))
                    or bool(forward and forward.get("error")))
    return 1 if bad or failed_parts else 0


if __name__ == "__main__":
    sys.exit(main())
