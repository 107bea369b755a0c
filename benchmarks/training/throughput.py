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

``--precision fp32 bf16 fp16`` measures every mode at each precision, all three ways under
the same autocast (``hadpsgd.run --precision``; fp16 with hadpsgd's loss scale, plain and DDP
with ``torch.amp.GradScaler``); ``t/t_fp32`` is a row's step time over the same mode's at
fp32 (below 1: faster than fp32). ``--grad-wire fp32 bf16`` adds SSGD rows with bf16
gradient buckets on the wire (``hadpsgd.run --grad-wire bf16``), with the bytes each rank
sent per step. Usage::

    python benchmarks/train_throughput.py [--presets small swb] [--ranks 1 2] [--json out.json]
    python benchmarks/train_throughput.py --precision fp32 bf16 --grad-wire fp32 bf16
    python benchmarks/train_throughput.py --device cuda --presets swb --ranks 1 2 \
        --precision fp32 bf16
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
PRECISIONS = ("fp32", "bf16", "fp16")
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
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=PRECISIONS,
                   help="measure at each of these precisions (as hadpsgd.run's --precision)")
    p.add_argument("--grad-wire", nargs="+", default=["fp32"], choices=("fp32", "bf16"),
                   help="SSGD's gradient wire formats to measure (as hadpsgd.run's "
                        "--grad-wire); DDP and plain rows are measured once")
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
    a.precision = list(dict.fromkeys(a.precision))
    a.grad_wire = list(dict.fromkeys(a.grad_wire))
    return a


def _precision(r: Mapping[str, Any]) -> str:
    return r.get("precision", "fp32")


def _wire(r: Mapping[str, Any]) -> str:
    return r.get("grad_wire") or "fp32"


def add_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Fill each row's ``ratio_vs_plain``, ``time_vs_ddp`` and ``time_vs_fp32`` in place.

    ``ratio_vs_plain``: frames/s over the plain loop's with the same preset, threads per rank
    and precision (> 1: more frames/s than one process). ``time_vs_ddp``: seconds per step
    over DDP's with the same preset, ranks and precision (> 1: slower than DDP); ``None`` for
    the plain rows and where that DDP row is missing. ``time_vs_fp32``: seconds per step over
    the same mode's (and wire's) at fp32 (< 1: faster than fp32); ``None`` where not measured.
    """
    plain = {(r["preset"], r["threads_per_rank"], _precision(r)): r for r in rows
             if r["mode"] == "plain"}
    ddp = {(r["preset"], r["ranks"], _precision(r)): r for r in rows if r["mode"] == "ddp"}
    # Keyed by threads too: the plain loop runs once per thread count with one rank.
    fp32 = {(r["preset"], r["ranks"], r["threads_per_rank"], r["mode"], _wire(r)): r
            for r in rows if _precision(r) == "fp32"}
    for r in rows:
        base = plain.get((r["preset"], r["threads_per_rank"], _precision(r)))
        r["ratio_vs_plain"] = r["frames_per_s"] / base["frames_per_s"] if base else None
        ref = ddp.get((r["preset"], r["ranks"], _precision(r))) if r["mode"] != "plain" \
            else None
        r["time_vs_ddp"] = r["sec_per_step"] / ref["sec_per_step"] if ref else None
        same = fp32.get((r["preset"], r["ranks"], r["threads_per_rank"], r["mode"], _wire(r)))
        r["time_vs_fp32"] = r["sec_per_step"] / same["sec_per_step"] if same else None


def _num(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


TABLE_HEADER = (f"{'preset':<7} {'mode':<11} {'prec':<4} {'wire':<4} {'ranks':>5} "
                f"{'device':<6} {'backend':<14} {'thr/rank':>8} {'batch/rank':>10} "
                f"{'s/step':>8} {'frames/s':>10} {'vs plain':>8} {'t/t_ddp':>8} "
                f"{'t/t_fp32':>8} {'MiB/step':>8}")
"""The header line of the stdout table."""


def format_row(row: Mapping[str, Any]) -> str:
    """One line of the stdout table (``-`` where a ratio does not apply)."""
    wire = _wire(row) if row["mode"].startswith("ssgd") else "-"
    sent = row.get("grad_wire_bytes_per_step")
    return (f"{row['preset']:<7} {row['mode']:<11} {_precision(row):<4} {wire:<4} "
            f"{row['ranks']:>5} {row['device']:<6} "
            f"{row.get('backend') or '-':<14} {row['threads_per_rank']:>8} "
            f"{row['batch_per_rank']:>10} {row['sec_per_step']:>8.3f} "
            f"{row['frames_per_s']:>10.0f} {_num(row.get('ratio_vs_plain'), '.2f', 8)} "
            f"{_num(row.get('time_vs_ddp'), '.2f', 8)} "
            f"{_num(row.get('time_vs_fp32'), '.2f', 8)} "
            f"{_num(sent / 2**20 if sent is not None else None, '.2f', 8)}")


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """The headline ratios by ``<preset>/<ranks>``: hadpsgd over DDP, both over plain.

    Other precisions than fp32 get keys of their own (``<preset>/<ranks>/bf16``), with
    ``<mode>_time_vs_fp32``; SSGD with bf16 on the wire is the mode ``ssgd_bf16wire``.
    """
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        if r["mode"] == "plain":
            continue
        key = f"{r['preset']}/{r['ranks']}"
        if _precision(r) != "fp32":
            key += f"/{_precision(r)}"
        entry = out.setdefault(key, {})
        mode = r["mode"].replace("-", "_") + ("_bf16wire" if _wire(r) == "bf16" else "")
        if _precision(r) != "fp32":
            entry[f"{mode}_time_vs_fp32"] = r.get("time_vs_fp32")
        if r["mode"] != "ddp":
            entry[f"{mode}_time_vs_ddp"] = r.get("time_vs_ddp")
        entry[f"{mode}_vs_plain"] = r.get("ratio_vs_plain")
        # Scaling efficiency: n ranks' frames/s over n plain processes' (1.0 = linear).
        ratio = r.get("ratio_vs_plain")
        entry[f"{mode}_efficiency"] = ratio / r["ranks"] if ratio is not None else None
    return out


def _measure(a: argparse.Namespace, cpus: int, common: list[str]) -> list[dict[str, Any]]:
    """One preset at one precision: plain once per thread count, every mode per rank count."""
    rows = []
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
            wires = a.grad_wire if mode.startswith("ssgd") and n > 1 else ["fp32"]
            for wire in wires:
                rows.append(run_worker(WORKER, ["--mode", mode, "--grad-wire", wire, *mine],
                                       n, a.timeout, env)[-1])
    return rows


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
        for precision in a.precision:
            common = ["--preset", preset, "--batch", str(batch), "--classes", str(classes),
                      "--steps", str(a.steps), "--warmup", str(a.warmup), "--device",
                      a.device, "--precision", precision]
            rows += _measure(a, cpus, common)
    add_ratios(rows)

    print(TABLE_HEADER)
    for r in rows:
        print(format_row(r))
    print("# vs plain: frames/s over one process with the threads of one rank; t/t_ddp: "
          "s/step over DDP's on the same ranks, batch and precision (> 1: slower than DDP); "
          "t/t_fp32: s/step over the same mode's at fp32; MiB/step: gradient bytes a rank "
          "sent per step")
    for note in dict.fromkeys(n for r in rows for n in r.get("notes", [])):
        print(f"# note: {note}")
    record = {"benchmark": "train_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cpus": cpus, "device": a.device, "rows": rows, "summary": summarize(rows)}
    emit(record, a.json)
    return 0
