"""Whether the gradient pipeline's progress tests move the link while the node works (issue 59).

On the pipeline's GPU route the node's phases are NCCL calls, not MPI ones, so an inter-node
``MPI_Iallreduce`` started for one piece advanced only when its piece's last phase waited for
it: the serial route plus copies. The pipeline now tests its pieces in flight around every
node phase (:mod:`hadpsgd.comm.pipeline`). Measured on CPU with gloo standing in for NCCL
(a node phase that is no MPI call), with Open MPI's own node phases as the control: per
node backend one job of 4 ranks as 2 nodes of 2 (on two emulated hosts with ``--two-hosts
RATE``), the serial mean, the pipelined one without the tests and with them, taking turns on
the same tensor. It cannot show what a GPU's NCCL kernels and a real NIC do side by side:
only whether MPI's requests move between the node's phases. Usage::

    python -m benchmarks.comm.pipeline_progress [--two-hosts 1gbit] [--json out.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit, run_worker

WORKER = "benchmarks.comm.pipeline_progress_worker"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per node backend and route: median seconds, against serial, early pieces."""
    lines = [f"{'node phases':<12} {'route':<30} {'s a mean':>9} {'vs serial':>10} "
             f"{'ended before wait':>18}"]
    for r in rows:
        early = "-" if r.get("early") is None else f"{r['early']:.0%}"
        lines.append(f"{r['intra']:<12} {r['route']:<30} {r['seconds']:>9.4f} "
                     f"{r['serial_over']:>9.2f}x {early:>18}")
    return "\n".join(lines)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's speed against the serial route of the same job (>1: faster)."""
    for r in rows:
        serial = next(s for s in rows if s["intra"] == r["intra"] and s["route"] == "serial")
        r["serial_over"] = serial["seconds"] / r["seconds"]


def main(argv: list[str] | None = None) -> int:
    """One job per node backend; print the table and the JSON record."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--intra", nargs="+", default=["gloo", "mpi"],
                   help="node backends, one job each (gloo stands in for NCCL)")
    p.add_argument("--mib", type=float, default=16.0, help="the tensor averaged, MiB")
    p.add_argument("--piece-mb", type=float, default=1.0, help="HADPSGD_PIPELINE_MB")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--two-hosts", default=None, metavar="RATE",
                   help="put the two nodes on two emulated hosts joined by a link of RATE "
                        "(e.g. 1gbit; needs root and iproute2)")
    p.add_argument("--json", type=Path)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for intra in a.intra:
        rows += run_worker(WORKER, ["--mib", str(a.mib), "--rounds", str(a.rounds)], 4,
                           a.timeout, {"HADPSGD_RANKS_PER_NODE": "2",
                                       "HADPSGD_INTRA_BACKEND": intra,
                                       "HADPSGD_PIPELINE_MB": str(a.piece_mb)},
                           two_hosts=a.two_hosts)
    add_ratios(rows)
    where = f"two emulated hosts ({a.two_hosts})" if a.two_hosts else "one host"
    print(f"mean of {a.mib:g} MiB over 4 ranks as 2 nodes of 2 on {where}, pieces of "
          f"{a.piece_mb:g} MiB, median of {a.rounds} rounds")
    print(table(rows))
    emit({"benchmark": "pipeline_progress", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "two_hosts": a.two_hosts, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
