"""BMUF throughput and traffic: frames/s at sync periods tau against local-only and SSGD.

One mpirun job runs, on the same ranks, model and per-rank batch: local-only training (no
communication at all), SSGD (a gradient allreduce every step) and BMUF at each tau (default
1, 8, 32; BMUF-Adam with the corrected moments, so a sync sends parameters, m and v), and
BMUF variants at one tau (``--variants overlap frag4 int8 overlap+int8``: the overlapped,
streaming and compressed block syncs). It
reports frames/s with the ratios to local-only and to SSGD, and the bytes each learner hands
to collectives per step (across super-learners / inside a node) with the ratio SSGD / BMUF.
Usage::

    python benchmarks/bmuf.py [-n 4] [--ranks-per-node 1] [--preset small] [--json out.json]
    python benchmarks/bmuf.py -n 2 --two-hosts 300mbit --taus 8 --variants overlap int8
    python benchmarks/bmuf.py -n 4 --two-hosts 1gbit --taus --pipeline-mb 0.5 4
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit, run_worker

WORKER = "benchmarks.training.bmuf_worker"
"""The module every rank of the job runs (all modes, one after the other)."""


def run_job(n: int, rpn: int | None, worker_args: list[str], timeout: float,
            two_hosts: str | None = None) -> list[dict[str, Any]]:
    """Run the worker on ``n`` ranks; returns its JSON rows (one per mode).

    ``rpn`` None: the nodes as they are (with ``two_hosts``, the two emulated hosts).
    """
    env = {} if rpn is None else {"HADPSGD_RANKS_PER_NODE": str(rpn)}
    return run_worker(WORKER, worker_args, n, timeout, env, two_hosts=two_hosts)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Ratios of every row to local-only (frames/s) and to SSGD (frames/s and bytes)."""
    by_mode = {r["mode"]: r for r in rows}
    local, ssgd = by_mode["local"], by_mode["ssgd"]
    for r in rows:
        r["fps_vs_local"] = r["frames_per_s"] / local["frames_per_s"]
        r["fps_vs_ssgd"] = r["frames_per_s"] / ssgd["frames_per_s"]
        r["ssgd_bytes_over_bytes"] = (ssgd["inter_bytes_per_step"] / r["inter_bytes_per_step"]
                                      if r["inter_bytes_per_step"] else None)


def table(rows: list[dict[str, Any]]) -> str:
    """The stdout table: one line per mode."""
    w = max(11, *(len(r["mode"]) for r in rows))
    lines = [f"{'mode':<{w}} {'s/step':>8} {'frames/s':>10} {'vs local':>8} {'vs ssgd':>8} "
             f"{'inter B/step':>13} {'intra B/step':>13} {'ssgd B / B':>10} "
             f"{'link B/step':>12}"]
    for r in rows:
        ratio, link = r["ssgd_bytes_over_bytes"], r.get("link_bytes_per_step")
        lines.append(
            f"{r['mode']:<{w}} {r['sec_per_step']:>8.4f} {r['frames_per_s']:>10.0f} "
            f"{r['fps_vs_local']:>8.2f} {r['fps_vs_ssgd']:>8.2f} "
            f"{r['inter_bytes_per_step']:>13,.0f} {r['intra_bytes_per_step']:>13,.0f} "
            f"{'-' if ratio is None else f'{ratio:.2f}':>10} "
            f"{'-' if link is None else f'{link:,.0f}':>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every mode in one job; print the table and the JSON record."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--ranks", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="learners per super-learner (emulated node); 1 = flat BMUF (default 1, "
                        "or the two hosts with --two-hosts)")
    p.add_argument("--two-hosts", metavar="RATE",
                   help="run half the ranks on each of two emulated hosts (network namespaces, "
                        "root) joined by a link of this rate, e.g. 300mbit: MPI between them "
                        "over TCP (benchmarks/_common/netns.py)")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=16, help="sub-sequences per rank per step")
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    p.add_argument("--adam-moments", default="corrected",
                   choices=["corrected", "average", "local", "reset"])
    p.add_argument("--taus", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--variants", nargs="*", default=[],
                   help="BMUF variants run at --variant-tau, each options joined by '+': "
                        "overlap (--bmuf-overlap), fragF (--bmuf-fragments F), bf16 / int8 "
                        "(--wire); e.g. overlap frag4 int8 overlap+int8")
    p.add_argument("--variant-tau", type=int, default=8)
    p.add_argument("--pipeline-mb", nargs="*", default=[],
                   help="also SSGD with the pipelined hierarchical gradient mean "
                        "(HADPSGD_PIPELINE_MB) at each of these piece sizes in MiB, beside "
                        "the serial default; --taus with no value leaves BMUF out")
    p.add_argument("--steps", type=int, default=64, help="timed steps per mode")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of every mode, in turn through the job; the median counts")
    p.add_argument("--json", type=Path, help="also write the JSON record here")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)

    rpn = a.ranks_per_node if a.ranks_per_node is not None or a.two_hosts else 1
    rows = run_job(a.ranks, rpn,
                   ["--preset", a.preset, "--batch", str(a.batch), "--classes", str(a.classes),
                    "--optimizer", a.optimizer, "--adam-moments", a.adam_moments,
                    "--steps", str(a.steps), "--rounds", str(a.rounds),
                    "--variant-tau", str(a.variant_tau),
                    "--pipeline-mb", *a.pipeline_mb,
                    "--taus", *map(str, a.taus), "--variants", *a.variants], a.timeout,
                   two_hosts=a.two_hosts)
    add_ratios(rows)
    first = rows[0]
    print(f"{first['preset']} BLSTM ({first['params']:,} parameters), {first['ranks']} ranks "
          f"on {first['nodes']} super-learners, {first['batch_per_rank']} x 21 frames per rank, "
          f"{a.optimizer} (BMUF moments: {a.adam_moments}), {a.steps} timed steps per mode, "
          f"median of {a.rounds} rounds")
    print(table(rows))
    if a.two_hosts:
        print(f"# two emulated hosts joined by a {a.two_hosts} link (MPI over TCP between them)")
    record = {"benchmark": "bmuf", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cpus": os.cpu_count(), "ranks_per_node": rpn, "two_hosts": a.two_hosts,
              "rows": rows}
    emit(record, a.json)
    return 0
