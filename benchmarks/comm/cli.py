"""Communication microbenchmark of ``hadpsgd.comm``, in the style of nccl-tests.

For every message size of a sweep (8 B to 256 MiB by powers of 2, float32) it times the
collectives of :class:`hadpsgd.comm.Topology` and, in the same run, the same operation through
raw mpi4py on NumPy buffers (and through a torch.distributed gloo world group for allreduce):

- ``allreduce``: ``Topology.allreduce_`` with ``path="flat"`` and, when there are several
  nodes and some node holds several ranks, ``path="hier"``; baselines ``comm.Allreduce`` and
  gloo ``pg.allreduce``;
- ``broadcast``: ``Topology.broadcast_`` from rank 0; baseline ``comm.Bcast``;
- ``exchange``: the gossip pair exchange ``Topology.exchange`` (ranks paired even/odd, one
  exchange timed); baseline ``comm.Sendrecv``;
- ``intra``: ``Topology.intra_allreduce_`` with each CPU intra-node backend (``mpi`` and
  ``gloo``), against ``Allreduce`` on the node communicator; with several nodes also the
  hierarchical allreduce per backend (the measurement behind the CPU default backend).

With ``--device cuda`` the hadpsgd cases reduce CUDA tensors (NCCL inside a node when it can
run, host-staged or CUDA-aware MPI between nodes, as ``Topology.route`` says), and the
baseline is raw mpi4py as a user would write it for device tensors: copy to a pinned host
buffer, call MPI on its NumPy view, copy back, synchronize. Where MPI is CUDA-aware a second
baseline hands the device tensor to mpi4py directly. The gloo baseline and the gloo
intra-node view are of host tensors and are skipped.

Usage::

    python -m benchmarks.comm -n 4 --ranks-per-node 2          # launches 4 local ranks
    python -m benchmarks.comm -n 4 --op intra                  # mpi vs gloo inside a node
    python -m benchmarks.comm -n 2 --device cuda               # device buffers (GPU mode)
    mpirun -np 64 python -m benchmarks.comm --no-launch        # inside an existing MPI job

This module is the driver (argument parsing and the launch); with the sweep, bandwidth, table
and summary helpers of :mod:`benchmarks.comm.report` it never imports MPI. The ranks run
:mod:`benchmarks.comm.worker`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks._common.launch import bench_env, cuda_missing, worker_command
from benchmarks.comm.report import (
    DEFAULT_OPS,
    DEVICES,
    INTRA_CHOICES,
    MIB,
    OPS,
    default_json_path,
    parse_size,
    size_sweep,
)
from hadpsgd.launch import LauncherError

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")
"""Variables that Open MPI, PMIx (srun --mpi=pmix), PMI-2 and MPICH's hydra set in ranks."""


def inside_mpi(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started as a rank by an MPI launcher (mpirun, srun, hydra)."""
    env = os.environ if env is None else env
    return any(name in env for name in _MPI_ENV)


# ---------------------------------------------------------------------------- CLI
def _ops(values: Sequence[str]) -> list[str]:
    names: list[str] = []
    for value in values:
        for name in filter(None, (v.strip() for v in value.split(","))):
            if name == "all":
                names.extend(OPS)
            elif name in OPS:
                names.append(name)
            else:
                raise argparse.ArgumentTypeError(
                    f"unknown op {name!r}; choose from {', '.join(OPS)} or all")
    return list(dict.fromkeys(names))


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.comm`` (driver and ranks share it)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.comm",
        description="nccl-tests-style sweep of hadpsgd.comm collectives against raw mpi4py "
                    "(and gloo) on the same ranks. Launches itself under the venv's mpirun "
                    "unless it already runs inside an MPI job (or --no-launch is given).",
    )
    g = p.add_argument_group("launch")
    g.add_argument("-n", "--nprocs", type=int, default=None,
                   help="ranks to launch locally (default 4; ignored inside an MPI job)")
    g.add_argument("--no-launch", "--worker", dest="no_launch", action="store_true",
                   help="run as a rank of an existing MPI job (detected automatically under "
                        "mpirun / srun)")
    g = p.add_argument_group("layout and backends (passed to hadpsgd.comm.init)")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulate nodes of k consecutive ranks (env HADPSGD_RANKS_PER_NODE)")
    g.add_argument("--intra-backend", default="auto", choices=["auto", *INTRA_CHOICES],
                   help="intra-node backend of the topology (default auto)")
    g.add_argument("--hier-algo", default="auto", choices=["auto", "shard", "leader"],
                   help="hierarchical algorithm (default auto)")
    g.add_argument("--bucket-mb", type=float, default=None,
                   help="bucket size in MiB (default: hadpsgd's, 64)")
    g.add_argument("--device", default="cpu", choices=DEVICES,
                   help="where the measured tensors live (default cpu). cuda: hadpsgd on "
                        "CUDA tensors against raw mpi4py with the host copies a user would "
                        "write (and on the device buffers where MPI is CUDA-aware)")
    g = p.add_argument_group("sweep")
    g.add_argument("--op", nargs="+", default=list(DEFAULT_OPS), metavar="OP",
                   help=f"ops among {', '.join(OPS)} or all (default: "
                        f"{' '.join(DEFAULT_OPS)}); 'intra' compares the intra backends")
    g.add_argument("--intra-backends", nargs="+", default=list(INTRA_CHOICES),
                   choices=INTRA_CHOICES, help="backends the intra op compares (default both)")
    g.add_argument("-b", "--min-bytes", type=_size_arg, default=8,
                   help="smallest message, e.g. 8, 4K (default 8)")
    g.add_argument("-e", "--max-bytes", type=_size_arg, default=256 * MIB,
                   help="largest message, e.g. 1M, 256M (default 256M)")
    g.add_argument("-f", "--step-factor", type=int, default=2,
                   help="size multiplier between steps (default 2)")
    g.add_argument("--iters", type=int, default=200,
                   help="timed iterations per measurement at most (default 200)")
    g.add_argument("--warmup", type=int, default=5,
                   help="untimed iterations before timing at most, the first of which checks "
                        "the result (default 5)")
    g.add_argument("--min-iters", type=int, default=3,
                   help="timed iterations per measurement at least (default 3)")
    g.add_argument("--max-time", type=float, default=0.25,
                   help="seconds the timed loop of one measurement (one variant, one size) "
                        "should take: iterations are lowered to fit, never below --min-iters "
                        "(default 0.25)")
    g.add_argument("--no-gloo", action="store_true",
                   help="skip the torch.distributed gloo allreduce baseline")
    g.add_argument("--gloo-dir", default=None,
                   help="directory of the gloo FileStore rendezvous file; must be shared by all "
                        "hosts (default: the system temp dir on one host, the JSON file's "
                        "directory across hosts)")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, default=None,
                   help="write the full results here (default bench-results/comm-<time>.json)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line."""
    p = build_parser()
    a = p.parse_args(argv)
    try:
        a.op = _ops(a.op)
        a.sizes = size_sweep(a.min_bytes, a.max_bytes, a.step_factor)
    except (argparse.ArgumentTypeError, ValueError) as err:
        p.error(str(err))
    if a.nprocs is not None and a.nprocs < 1:
        p.error(f"-n must be >= 1, got {a.nprocs}")
    if a.iters < 1 or a.min_iters < 1 or a.warmup < 0 or a.max_time <= 0:
        p.error("--iters and --min-iters must be >= 1, --warmup >= 0, --max-time > 0")
    if a.ranks_per_node is not None and a.ranks_per_node < 1:
        p.error(f"--ranks-per-node must be >= 1, got {a.ranks_per_node}")
    a.intra_backends = list(dict.fromkeys(a.intra_backends))
    return a


def worker_argv(a: argparse.Namespace, json_path: Path) -> list[str]:
    """The rank-side arguments reproducing the options of ``a`` (layout goes by environment)."""
    argv = ["--no-launch", "--intra-backend", a.intra_backend, "--hier-algo", a.hier_algo,
            "--op", *a.op, "--intra-backends", *a.intra_backends,
            "--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes),
            "--step-factor", str(a.step_factor), "--iters", str(a.iters),
            "--warmup", str(a.warmup), "--min-iters", str(a.min_iters),
            "--max-time", str(a.max_time), "--json", str(json_path)]
    if a.bucket_mb is not None:
        argv += ["--bucket-mb", str(a.bucket_mb)]
    if a.device != "cpu":
        argv += ["--device", a.device]
    if a.no_gloo:
        argv.append("--no-gloo")
    if a.gloo_dir:
        argv += ["--gloo-dir", a.gloo_dir]
    return argv


def launch(a: argparse.Namespace) -> int:
    """Run this benchmark on ``a.nprocs`` local ranks under the venv's mpirun; its exit code."""
    nprocs = a.nprocs or 4
    json_path = a.json or default_json_path()
    try:
        cmd = worker_command("benchmarks.comm", worker_argv(a, json_path), nprocs)
    except LauncherError as err:
        print(f"benchmarks.comm: {err}", file=sys.stderr)
        return 2
    # The layout goes by environment, so the ranks' command line stays the user's options.
    extra = ({"HADPSGD_RANKS_PER_NODE": str(a.ranks_per_node)}
             if a.ranks_per_node is not None else None)
    print("# " + " ".join(cmd), flush=True)
    try:
        return subprocess.call(cmd, env=bench_env(nprocs, extra))
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: launch the ranks, or be one."""
    a = parse_args(argv)
    if cuda_missing("benchmarks.comm", a.device):
        return 2
    if a.no_launch or inside_mpi():
        # Only in the ranks: the worker imports MPI and torch, the driver needs neither.
        from benchmarks.comm.worker import run

        return run(a)
    return launch(a)
