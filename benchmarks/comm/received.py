"""Bytes received per learner across super-learners as their number grows (counts, not time).

A sparse top-k block delta cannot be summed on the wire, so how it is averaged decides what a
learner receives as the super-learners grow. BMUF's compressed block sync
(:class:`hadpsgd.comm.compressed.CompressedMean`) is a two-stage exchange that densifies in
the middle: an all-to-all of encoded shards (each learner receives N - 1 shards of 1/N of the
tensor), each shard averaged and re-encoded (with server-side error feedback), an allgather
of the encoded means (again N - 1 shards of 1/N). So a learner receives 2 (N - 1) / N of one
encoded tensor whatever N is, as a ring allreduce of dense values would, and never the
N - 1 whole sparse messages an all-gather of top-k deltas would bring. ADPSGD's gossip is
pairwise: one model in, one out, at any N.

For each number of super-learners (emulated: every rank its own node, on this machine) one
job runs :mod:`benchmarks.comm.received_worker`, which builds each configuration through the
algorithm registry and reads its own counters. Usage::

    python -m benchmarks.comm.received [--learners 2 4 8 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit, run_worker

WORKER = "benchmarks.comm.received_worker"


def table(rows: list[dict[str, Any]], learners: list[int]) -> str:
    """Received bytes per learner and exchange, one row per configuration, one column per N."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by = {(r["config"], r["learners"]): r for r in rows}
    head = f"{'configuration':<16} {'per':<9}" + "".join(f"{f'N={n}':>16}" for n in learners)
    lines = [head]
    for c in configs:
        per = "exchange" if c.startswith("adpsgd") else "sync" if c.startswith("bmuf") else "step"
        cells = []
        for n in learners:
            r = by.get((c, n))
            ratio = "-" if r is None or r["ssgd_over"] is None else f"{r['ssgd_over']:,.0f}x"
            cells.append("-" if r is None else f"{r['received']:,.0f} ({ratio})")
        lines.append(f"{c:<16} {per:<9}" + "".join(f"{x:>16}" for x in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one job per number of learners; print the table and the JSON record."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--learners", type=int, nargs="+", default=[2, 4, 8, 64])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for n in a.learners:
        got = run_worker(WORKER, ["--preset", a.preset, "--steps", str(a.steps)], n, a.timeout,
                         {"HADPSGD_RANKS_PER_NODE": "1"})
        ssgd = next(r for r in got if r["config"] == "ssgd fp32")
        for r in got:  # SSGD fp32's bytes in one step over this configuration's in one exchange
            r["ssgd_over"] = ssgd["received"] / r["received"] if r["received"] else None
        rows += got
    print(f"{a.preset} BLSTM ({rows[0]['params']:,} parameters): bytes a learner receives "
          "across super-learners per exchange (SSGD fp32's per step over it)")
    print(table(rows, a.learners))
    emit({"benchmark": "received", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "preset": a.preset, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
