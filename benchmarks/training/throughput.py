"""Training throughput of hadpsgd SSGD against torch DDP and a plain single-process loop.

For each preset (``small``, ``swb``) and rank count (1, 2) it runs the same model and per-rank
batch on random in-memory data (so only compute and communication are measured) three ways,
all in the same run:

- ``plain``: one process, no communication, with the threads one rank gets (so ``vs plain``
  compares like with like: a rank of an n-rank job against one process of the same size);
- ``ssgd``: hadpsgd SSGD on n MPI ranks;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the same n ranks, the same
  batch, over a torch.distributed group (gloo on CPU, NCCL with ``--device cuda``).

One step is forward, backward and the optimizer step. It reports frames/s, the ratio to the
plain loop, and hadpsgd's step time over DDP's (``t/t_ddp``: above 1, hadpsgd is slower).
Usage::

    python benchmarks/train_throughput.py [--presets small swb] [--ranks 1 2] [--json out.json]
    python benchmarks/train_throughput.py --device cuda --presets swb --ranks 1 2
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import cuda_missing, emit, run_worker

WORKER = "benchmarks.training.throughput_worker"
"""The module each measurement runs (one process, or every rank of an mpirun job)."""
# Per-rank batch and classes: the paper's 128 x 21 frames and 32,000 classes for swb would
# take minutes per step on a 2-core CPU, so the CPU defaults are smaller (flags override).
DEFAULTS = {"small": (32, 64), "swb": (8, 32000)}
FALLBACK = (16, 64)
"""Per-rank batch and classes of a preset that :data:`DEFAULTS` does not name."""
DEVICES = ("cpu", "cuda")
MODES = ("plain", "ssgd", "ssgd-overlap", "ssgd-serial", "ddp")
"""``ssgd``: hadpsgd SSGD as ``hadpsgd.run`` runs it (``--overlap auto``: buckets reduced
during backward on CUDA, after it on CPU); ``ssgd-overlap`` / ``ssgd-serial``: the other
setting (``--overlap on`` on CPU, ``off`` on CUDA), to show what the default buys."""


def modes_for(device: str) -> list[str]:
    """The modes one measurement runs on ``device``: the default SSGD and its alternative."""
    other = "ssgd-overlap" if device == "cpu" else "ssgd-serial"
    return ["ssgd", other, "ddp"]


def threads_per_rank(cpus: int, nranks: int) -> int:
    """Torch threads each of ``nranks`` ranks on a ``cpus``-core machine gets.

    The same rule as the launcher's ``OMP_NUM_THREADS`` (``hadpsgd.launch.launch_env``): the
    cores shared out, at least one each.
    """
    return max(1, cpus // max(1, nranks))


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks/train_throughput.py``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["small", "swb"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batch", type=int, help="per-rank batch (default: per preset)")
    p.add_argument("--classes", type=int, help="output classes (default: per preset)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="where the model trains (default cpu); cuda: one GPU per rank by its "
                        "rank on the host, DDP over NCCL")
    p.add_argument("--json", type=Path, help="also write the JSON record here")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds each measurement (one mpirun job) may take")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (exits with a usage error on bad values)."""
    p = build_parser()
    a = p.parse_args(argv)
    if any(n < 1 for n in a.ranks):
        p.error(f"--ranks must all be >= 1, got {a.ranks}")
    for name in ("batch", "classes", "steps"):
        value = getattr(a, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1, got {value}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    a.ranks = list(dict.fromkeys(a.ranks))
    return a


def add_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Fill each row's ``ratio_vs_plain`` and ``time_vs_ddp`` in place.

    ``ratio_vs_plain``: frames/s over the plain loop's with the same preset and threads per
    rank (> 1: more frames/s than one process). ``time_vs_ddp``: seconds per step over DDP's
    with the same preset and ranks (> 1: slower than DDP); ``None`` for the plain rows and
    where that DDP row is missing.
    """
    plain = {(r["preset"], r["threads_per_rank"]): r for r in rows if r["mode"] == "plain"}
    ddp = {(r["preset"], r["ranks"]): r for r in rows if r["mode"] == "ddp"}
    for r in rows:
        base = plain.get((r["preset"], r["threads_per_rank"]))
        r["ratio_vs_plain"] = r["frames_per_s"] / base["frames_per_s"] if base else None
        ref = ddp.get((r["preset"], r["ranks"])) if r["mode"] != "plain" else None
        r["time_vs_ddp"] = r["sec_per_step"] / ref["sec_per_step"] if ref else None


def _num(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


TABLE_HEADER = (f"{'preset':<7} {'mode':<11} {'ranks':>5} {'device':<6} {'backend':<14} "
                f"{'thr/rank':>8} {'batch/rank':>10} {'s/step':>8} {'frames/s':>10} "
                f"{'vs plain':>8} {'t/t_ddp':>8}")
"""The header line of the stdout table."""


def format_row(row: Mapping[str, Any]) -> str:
    """One line of the stdout table (``-`` where a ratio does not apply)."""
    return (f"{row['preset']:<7} {row['mode']:<11} {row['ranks']:>5} {row['device']:<6} "
            f"{row.get('backend') or '-':<14} {row['threads_per_rank']:>8} "
            f"{row['batch_per_rank']:>10} {row['sec_per_step']:>8.3f} "
            f"{row['frames_per_s']:>10.0f} {_num(row.get('ratio_vs_plain'), '.2f', 8)} "
            f"{_num(row.get('time_vs_ddp'), '.2f', 8)}")


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """The headline ratios by ``<preset>/<ranks>``: hadpsgd over DDP, both over plain."""
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        if r["mode"] == "plain":
            continue
        entry = out.setdefault(f"{r['preset']}/{r['ranks']}", {})
        mode = r["mode"].replace("-", "_")
        if r["mode"] != "ddp":
            entry[f"{mode}_time_vs_ddp"] = r.get("time_vs_ddp")
        entry[f"{mode}_vs_plain"] = r.get("ratio_vs_plain")
        # Scaling efficiency: n ranks' frames/s over n plain processes' (1.0 = linear).
        ratio = r.get("ratio_vs_plain")
        entry[f"{mode}_efficiency"] = ratio / r["ranks"] if ratio is not None else None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run every measurement, print the table and the JSON record; exit code."""
    a = parse_args(argv)
    if cuda_missing("train_throughput", a.device):
        return 2
    cpus = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    for preset in a.presets:
        batch, classes = DEFAULTS.get(preset, FALLBACK)
        batch, classes = a.batch or batch, a.classes or classes
        common = ["--preset", preset, "--batch", str(batch), "--classes", str(classes),
                  "--steps", str(a.steps), "--warmup", str(a.warmup), "--device", a.device]
        plain_threads: set[int] = set()
        for n in a.ranks:
            threads = threads_per_rank(cpus, n)
            # The thread count goes by argument and by OMP_NUM_THREADS, so that neither
            # torch's default (every core) nor the launcher's share decides it.
            mine = ["--threads", str(threads), *common]
            env = {"OMP_NUM_THREADS": str(threads)}
            if threads not in plain_threads:
                plain_threads.add(threads)
                rows.append(run_worker(WORKER, ["--mode", "plain", *mine], None, a.timeout,
                                       env)[-1])
            for mode in modes_for(a.device):
                rows.append(run_worker(WORKER, ["--mode", mode, *mine], n, a.timeout, env)[-1])
    add_ratios(rows)

    print(TABLE_HEADER)
    for r in rows:
        print(format_row(r))
    print("# vs plain: frames/s over one process with the threads of one rank; t/t_ddp: "
          "s/step over DDP's on the same ranks and batch (> 1: slower than DDP)")
    for note in dict.fromkeys(n for r in rows for n in r.get("notes", [])):
        print(f"# note: {note}")
    record = {"benchmark": "train_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cpus": cpus, "device": a.device, "rows": rows, "summary": summarize(rows)}
    emit(record, a.json)
    return 0
