"""Project the speedup of SSGD, BMUF and (H-)ADPSGD from 1 to 64 learners with an alpha-beta model.

Two clusters:

- ``paper``: the h-adpsgd paper's (8 V100 per server, a fast in-node link, 100 Gb/s Ethernet
  between servers) with the SWB BLSTM (43,154,944 fp32 parameters); every figure is a named
  constant below, with its source or the assumption behind it;
- ``local``: this machine, its links fitted on ``benchmarks.comm`` JSON records (default: every
  ``bench-results/comm*.json``) and its compute step timed here (or ``--compute-s``), nodes of
  ``--ranks-per-node`` learners like it.

The formulas, and what they leave out, are in :mod:`lab.projection.costmodel`: the
projections are throughput upper bounds (no stragglers, no data loading, no convergence
differences). Beside them the table sets the speedups the papers report; those were measured on
other models and clusters (the BMUF-Adam ones on an OCR model with 4 V100 per node), so compare
shapes, not decimals.

Usage::

    python -m lab.project                                  # paper + local (measured)
    python -m lab.project --comm-json bench-results/comm-2x2.json --preset small
    python -m lab.project --compute-s 0.05 --cluster local --json proj.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit
from lab.projection import bmuf_link
from lab.projection.calibrate import (
    calibrate,
    default_comm_files,
    load_comm_records,
    measure_compute,
)
from lab.projection.costmodel import ALGOS, Cluster, Link, layout, speedup, step_time

# ---------------------------------------------------------------------------- the paper's cluster
SWB_PARAMS = 43_154_944
"""Parameters of the SWB BLSTM (6 x 512 BLSTM, 256 projection, 260 inputs, 32,000 classes)."""
SWB_BYTES = 4 * SWB_PARAMS
"""fp32 model (and gradient) bytes: 172.6 MB (the paper: "about 165MB", i.e. MiB)."""
PAPER_RANKS_PER_NODE = 8
"""h-adpsgd §5.1: 8 servers with 8 V100 each."""
PAPER_COMPUTE_S = 203 * 3600 / (16 * 2000 * 3600 * 100 / (128 * 21))
"""One V100 step at 128 sub-sequences of 21 frames, derived from h-adpsgd §6.2: 203 hours for
16 epochs of SWB-2000 on one GPU, taking SWB-2000 as 2000 h of audio at 100 frames/s (10 ms
frame shift): 7.2e8 frames = 267,857 steps per epoch, so 0.170 s per step."""
PAPER_INTRA = Link(alpha=3e-6, beta=1 / 100e9)
"""Assumed NVLink-class in-node link: 3 us per ring step (NCCL's small-message allreduce on 8
V100 takes tens of microseconds over 14 steps) and 100 GB/s per direction (the order of the
allreduce bus bandwidth nccl-tests reports on NVLink V100 servers). The paper itself only says
GPUs attach to the CPUs over PCIe Gen3, 16 GB/s per direction per socket; with a PCIe path
set beta to about 1 / 12e9."""
PAPER_INTER = Link(alpha=25e-6, beta=1 / 10e9)
"""Assumed 100 Gb/s Ethernet between servers (h-adpsgd §5.1): 12.5 GB/s line rate, of which MPI
over TCP or RoCE is assumed to get 10 GB/s (80 %), and 25 us per message (typical MPI latency
over Ethernet: tens of microseconds)."""

REPORTED = (
    {"algo": "h-adpsgd", "learners": 64, "speedup": 40.0,
     "source": "h-adpsgd paper §6.2 / Fig. 4: SWB-2000 BLSTM, 64 V100 (8 per node), 100 Gb/s "
               "Ethernet, batch 128 per GPU (203 h -> 5.2 h)"},
    {"algo": "bmuf", "learners": 64, "speedup": 54.13, "sync_period": 8,
     "source": "bmuf-adam paper Table 2: BMUF-Adam, OCR DarkNet-DBLSTM, 64 V100 (4 per node), "
               "Ethernet, tau = 8"},
    {"algo": "ssgd", "learners": 64, "speedup": 48.71,
     "source": "bmuf-adam paper Table 2: Sync-Adam (Horovod), same OCR model and cluster"},
)
"""Speedups the papers report, set beside the projections."""

ASSUMPTIONS = [
    "alpha-beta links: moving n bytes costs alpha + n*beta; collectives are ring algorithms",
    "hierarchical allreduce = ring(n, k, intra) + ring(n, N, inter): the k shard allreduces "
    "across nodes share one network interface per node",
    "ssgd: gradient allreduce after backward, not overlapped with compute",
    "bmuf: intra-node gradient allreduce every step; every tau steps an inter-node allreduce "
    "of model + moments (sync_buffers x model bytes) and an intra-node allgather",
    "h-adpsgd: intra-node gradient allreduce every step; the leaders' pair exchange runs in "
    "the background (at most one per step), only the in-node broadcast of the delta blocks",
    "adpsgd (flat): every learner gossips in the background; compute never waits",
    "not modelled: host staging, update/delta application, data loading, evaluation, "
    "stragglers, contention, and epochs to converge (throughput upper bounds)",
    "speedup(p) = p * T(1) / T(p); T(1) is the compute step alone",
]


def paper_cluster(ranks_per_node: int = PAPER_RANKS_PER_NODE) -> Cluster:
    """The h-adpsgd paper's cluster and model, from the constants above."""
    return Cluster("paper", PAPER_INTRA, PAPER_INTER, ranks_per_node, PAPER_COMPUTE_S,
                   SWB_BYTES, "8 V100/node, NVLink-class intra (assumed), 100 Gb/s Ethernet, "
                   "SWB BLSTM fp32; compute from the paper's 203 GPU-hours")


def project(cluster: Cluster, learners: Sequence[int], sync_period: int,
            sync_buffers: int) -> list[dict[str, Any]]:
    """One row per learner count: the layout and, per algorithm, speedup and step time."""
    rows = []
    for p in learners:
        k, nodes = layout(p, cluster.ranks_per_node)
        row: dict[str, Any] = {"learners": p, "per_node": k, "nodes": nodes}
        for algo in ALGOS:
            cost = step_time(algo, p, cluster, sync_period=sync_period,
                             sync_buffers=sync_buffers)
            s = speedup(algo, p, cluster, sync_period=sync_period, sync_buffers=sync_buffers)
            row[algo] = {"speedup": s, "efficiency": s / p, "step_s": cost.total_s,
                         "exposed_comm_s": cost.exposed_comm_s,
                         "exchanges_per_step": cost.exchanges_per_step}
        rows.append(row)
    return rows


def _describe(c: Cluster) -> str:
    return (f"# cluster {c.name}: {c.ranks_per_node} learners/node; intra alpha "
            f"{c.intra.alpha * 1e6:.2f} us, {c.intra.gbps:.2f} GB/s; inter alpha "
            f"{c.inter.alpha * 1e6:.2f} us, {c.inter.gbps:.2f} GB/s; compute "
            f"{c.compute_s * 1e3:.2f} ms/step; model {c.model_bytes / 1e6:.2f} MB"
            + (f"\n#   ({c.note})" if c.note else ""))


def format_table(cluster: Cluster, rows: Sequence[dict[str, Any]]) -> str:
    """The stdout table of one cluster: speedup (efficiency) per algorithm and learner count."""
    head = f"#{'learners':>9} {'nodes':>6}" + "".join(f" {a:>16}" for a in ALGOS)
    lines = [_describe(cluster), head]
    for r in rows:
        cells = "".join(f" {r[a]['speedup']:>8.2f}x ({r[a]['efficiency']:4.0%})" for a in ALGOS)
        lines.append(f" {r['learners']:>9} {r['nodes']:>6}{cells}")
    return "\n".join(lines)


def compare_reported(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The papers' reported speedups with the projection at the same learner count."""
    by_p = {r["learners"]: r for r in rows}
    out = []
    for rep in REPORTED:
        row = by_p.get(rep["learners"])
        out.append({**rep, "projected": row[rep["algo"]]["speedup"] if row else None})
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m lab.project``."""
    p = argparse.ArgumentParser(
        prog="python -m lab.project",
        description="Alpha-beta projection of SSGD / BMUF / (H-)ADPSGD speedups over 1-64 "
                    "learners on the papers' cluster and on this machine (calibrated).")
    p.add_argument("--cluster", default="paper,local",
                   help="comma list of clusters: paper, local (default both)")
    p.add_argument("--learners", default="1,2,4,8,16,32,64",
                   help="comma list of learner counts (default 1,2,4,8,16,32,64)")
    p.add_argument("--ranks-per-node", type=int, default=8,
                   help="learners per node for both clusters (default 8)")
    p.add_argument("--sync-period", type=int, default=8, help="BMUF tau (default 8)")
    p.add_argument("--sync-buffers", type=int, default=3,
                   help="model-sized buffers per BMUF sync: 3 = model + Adam m, v (default)")
    g = p.add_argument_group("local calibration")
    g.add_argument("--comm-json", type=Path, nargs="+", default=None,
                   help="benchmarks.comm JSON records (default bench-results/comm*.json)")
    g.add_argument("--compute-s", type=float, default=None,
                   help="seconds per local step (default: time one step of --preset here)")
    g.add_argument("--preset", default="small", help="model preset to time (default small)")
    g.add_argument("--batch", type=int, default=32, help="per-learner batch (default 32)")
    g.add_argument("--num-classes", type=int, default=None,
                   help="output classes (default 32000 for swb, else 64 as the synthetic set)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads while timing the step (default 1: a core per learner)")
    g.add_argument("--params", type=int, default=None,
                   help="model parameters (default: those of --preset)")
    p.add_argument("--inter-gbit", type=float, default=None,
                   help="the papers' cluster with this achieved network rate in Gbit/s "
                        "(default 80: 100 Gb/s Ethernet at 80 %%); e.g. 8 for 10 Gb/s")
    p.add_argument("--bmuf-json", type=Path, default=None,
                   help="a benchmarks/bmuf.py --two-hosts JSON record: fit the network link "
                        "to its blocking BMUF row and check the model on its other rows")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON record here")
    return p


def local_cluster(a: argparse.Namespace) -> tuple[Cluster, dict[str, Any]]:
    """This machine's cluster from the comm JSON and a timed (or given) compute step."""
    files = a.comm_json if a.comm_json is not None else default_comm_files()
    if not files:
        raise ValueError("no comm benchmark JSON: run python -m benchmarks.comm -n 4 "
                         "--ranks-per-node 2 --op allreduce intra exchange, or pass --comm-json")
    cal = calibrate(load_comm_records(files))
    classes = a.num_classes or (32000 if a.preset == "swb" else 64)
    params = a.params
    compute = a.compute_s
    if compute is None or params is None:
        measured, counted = measure_compute(a.preset, a.batch, num_classes=classes,
                                            threads=a.threads)
        compute = measured if compute is None else compute
        params = counted if params is None else params
    info = {"files": cal.files, "notes": cal.notes, "intra": cal.intra.as_dict(),
            "inter": cal.inter.as_dict(), "compute_s": compute,
            "compute_source": "compute step given by --compute-s" if a.compute_s is not None else
            f"timed: {a.preset} preset, batch {a.batch}, one forward/backward/SGD step here, "
            f"{a.threads} thread(s)",
            "params": params}
    note = (f"links fitted on {len(cal.files)} comm JSON file(s); {info['compute_source']}; "
            f"{params:,} fp32 parameters")
    return Cluster("local", cal.intra.link, cal.inter.link, a.ranks_per_node, compute,
                   4 * params, note), info


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: print the tables and the JSON record."""
    a = build_parser().parse_args(argv)
    try:
        learners = [int(x) for x in a.learners.split(",") if x.strip()]
        names = [x.strip() for x in a.cluster.split(",") if x.strip()]
        if not learners or min(learners) < 1:
            raise ValueError("--learners needs positive counts")
        if set(names) - {"paper", "local"} or not names:
            raise ValueError(f"--cluster takes paper and/or local, got {a.cluster!r}")
        clusters: list[tuple[Cluster, dict[str, Any]]] = []
        if "paper" in names:
            paper = paper_cluster(a.ranks_per_node)
            if a.inter_gbit is not None:
                if a.inter_gbit <= 0:
                    raise ValueError(f"--inter-gbit must be > 0, got {a.inter_gbit}")
                paper = replace(paper, inter=Link(paper.inter.alpha, 8 / (a.inter_gbit * 1e9)),
                                note=paper.note + f"; network {a.inter_gbit:g} Gbit/s achieved")
            clusters.append((paper, {}))
        if "local" in names:
            clusters.append(local_cluster(a))
        record: dict[str, Any] = {"benchmark": "project", "assumptions": ASSUMPTIONS,
                                  "sync_period": a.sync_period, "sync_buffers": a.sync_buffers,
                                  "clusters": {}}
        if a.bmuf_json is not None:
            link = bmuf_link.fit(bmuf_link.load(a.bmuf_json))
            print(bmuf_link.format_fit(link, a.bmuf_json))
            print()
            record["bmuf_link"] = link
        for cluster, info in clusters:
            rows = project(cluster, learners, a.sync_period, a.sync_buffers)
            print(format_table(cluster, rows))
            for level in ("intra", "inter"):
                if level in info:
                    fit = info[level]
                    print(f"#   {level} fit: {fit['source']}, {fit['rows']} sizes, rms relative "
                          f"error {fit['rms_rel_error']:.0%}")
            for note in info.get("notes", []):
                print(f"#   note: {note}")
            entry: dict[str, Any] = {
                "ranks_per_node": cluster.ranks_per_node, "compute_s": cluster.compute_s,
                "model_bytes": cluster.model_bytes,
                "intra": {"alpha_s": cluster.intra.alpha, "beta_s_per_byte": cluster.intra.beta},
                "inter": {"alpha_s": cluster.inter.alpha, "beta_s_per_byte": cluster.inter.beta},
                "note": cluster.note, "rows": rows}
            if info:
                entry["calibration"] = info
            if cluster.name == "paper":
                entry["reported"] = compare_reported(rows)
                print("# reported by the papers (other models/clusters) vs this projection:")
                for rep in entry["reported"]:
                    proj = "-" if rep["projected"] is None else f"{rep['projected']:.1f}x"
                    print(f"#   {rep['algo']:>9} @ {rep['learners']}: reported "
                          f"{rep['speedup']:.1f}x, projected {proj}  ({rep['source']})")
            record["clusters"][cluster.name] = entry
            print()
    except ValueError as err:
        print(f"lab.project: error: {err}", file=sys.stderr)
        return 2
    print("# assumptions: " + "; ".join(ASSUMPTIONS))
    emit(record, a.json)
    return 0
