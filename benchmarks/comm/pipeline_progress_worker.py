"""The pipelined hierarchical mean with and without its progress tests, beside the serial one.

Run by :mod:`benchmarks.comm.pipeline_progress` under mpirun on a hierarchical world
(``HADPSGD_RANKS_PER_NODE``), with the node's phases on the backend ``HADPSGD_INTRA_BACKEND``
names: gloo stands in for NCCL (a node phase that is no MPI call, so nothing but the
pipeline's own tests moves a started inter-node allreduce), mpi is the control (its node
phases progress every pending request anyway). The three routes take turns within each
round, on the same tensor, so the machine's drift falls on all of them alike. Rank 0 prints
one JSON line per route: the median seconds of a mean, and the share of pieces whose
allreduce had ended before their last phase began.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from hadpsgd import comm


def _timed(topo: comm.Topology, op: Callable[[], None]) -> float:
    """Seconds of ``op`` on the slowest rank (every rank starts it together)."""
    topo.barrier()
    start = time.perf_counter()
    op()
    return max(topo.allgather_object(time.perf_counter() - start))


def main() -> None:
    """Every route, ``--rounds`` times each, interleaved; rank 0 prints the rows."""
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, default=16.0, help="the tensor averaged, MiB")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    topo = comm.init()
    pipe = topo.grad_pipeline()
    if pipe is None:
        raise SystemExit("no gradient pipeline: needs a hierarchical world, "
                         "MPI_THREAD_MULTIPLE and HADPSGD_PIPELINE_MB > 0")
    t = torch.randn(int(a.mib * 2**20) // 4, generator=torch.Generator().manual_seed(topo.rank))

    def piped(progress: bool) -> Callable[[], None]:
        def op() -> None:
            pipe.progress = progress
            pipe.mean_(t, topo.size)
            pipe.drain()
        return op

    routes: dict[str, Callable[[], None]] = {
        "serial": lambda: topo.allreduce_(t, op="avg"),
        "pipelined, no progress tests": piped(False),
        "pipelined, progress tests": piped(True)}
    seconds: dict[str, list[float]] = {name: [] for name in routes}
    early: dict[str, list[float]] = {name: [] for name in routes}
    for r in range(a.rounds + 1):  # the first round warms every route up, uncounted
        for name, op in routes.items():
            pipe.pieces, pipe.early = 0, 0
            took = _timed(topo, op)
            share = pipe.early / pipe.pieces if pipe.pieces else float("nan")
            if r:
                seconds[name].append(took)
                early[name].append(share)
    intra = type(topo.reducer.intra).__name__
    for name in routes:
        # The early share of rank 0 (a leader of its shard's allreduce in every form).
        row = {"route": name, "intra": intra, "ranks": topo.size, "nodes": topo.num_nodes,
               "mib": a.mib, "piece_mib": pipe.piece_bytes / 2**20,
               "seconds": statistics.median(seconds[name]), "all_seconds": seconds[name]}
        if name != "serial":
            row["early"] = statistics.mean(early[name])
        if topo.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
