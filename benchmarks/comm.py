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

The driver part of this module (argument parsing, the launch, the sweep and bandwidth helpers,
the table and the summary) never imports MPI; the ranks run :mod:`benchmarks._comm_worker`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

OPS = ("allreduce", "broadcast", "exchange", "intra")
"""Operations ``--op`` accepts (``all`` selects every one)."""
DEFAULT_OPS = ("allreduce", "broadcast", "exchange")
INTRA_CHOICES = ("mpi", "gloo")
"""CPU intra-node backends the ``intra`` mode compares."""
DEVICES = ("cpu", "cuda")
"""Where the measured tensors live (``--device``)."""
ELEMENT_BYTES = 4
"""Bytes per element: every buffer is float32."""
KIB, MIB = 2**10, 2**20

_UNITS = {"": 1, "K": KIB, "M": MIB, "G": 2**30, "T": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(?:([KMGT])(?:I?B)?|B)?\s*$", re.IGNORECASE)
_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")
"""Variables that Open MPI, PMIx (srun --mpi=pmix), PMI-2 and MPICH's hydra set in ranks."""

__all__ = ["DEFAULT_OPS", "DEVICES", "OPS", "bandwidths", "build_parser", "bus_factor",
           "compare_backends", "default_json_path", "format_row", "format_size", "inside_mpi",
           "intra_view_names", "main", "parse_args", "parse_size", "plan_iters", "size_sweep",
           "summarize", "table_header"]


# ---------------------------------------------------------------------------- helpers
def parse_size(text: str | int) -> int:
    """Bytes from a size such as ``8``, ``4K``, ``256M``, ``1GiB`` (binary units, as nccl-tests).

    Args:
        text: A non-negative number with an optional ``K``/``M``/``G``/``T`` suffix, optionally
            followed by ``B`` or ``iB``; every unit is a power of 1024.

    Returns:
        The size in bytes.

    Raises:
        ValueError: If ``text`` is not such a size or is not a whole number of bytes.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 8, 4K, 256M or 1G")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    """``nbytes`` with the largest binary unit that divides it, e.g. ``1 KiB``, ``256 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_sweep(min_bytes: int, max_bytes: int, step_factor: int = 2,
               element_bytes: int = ELEMENT_BYTES) -> list[int]:
    """Message sizes in bytes from ``min_bytes`` to ``max_bytes``, times ``step_factor`` each step.

    Sizes are whole elements: each is rounded down to a multiple of ``element_bytes``.

    Raises:
        ValueError: For an empty or endless sweep.
    """
    if min_bytes < element_bytes:
        raise ValueError(f"--min-bytes must be at least one element ({element_bytes} B), "
                         f"got {min_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"--max-bytes ({max_bytes}) is smaller than --min-bytes ({min_bytes})")
    if step_factor < 2:
        raise ValueError(f"--step-factor must be >= 2, got {step_factor}")
    sizes: list[int] = []
    size = min_bytes
    while size <= max_bytes:
        rounded = size - size % element_bytes
        if not sizes or sizes[-1] != rounded:
            sizes.append(rounded)
        size *= step_factor
    return sizes


def bus_factor(op: str, nranks: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth.

    ``2 (n - 1) / n`` for an allreduce over ``n`` ranks (each byte crosses the busiest link
    that many times in the optimal algorithm), 1 for broadcast and for the pair exchange (each
    rank sends and receives the message once).

    Raises:
        ValueError: For an unknown ``op`` or ``nranks < 1``.
    """
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if op in ("allreduce", "intra"):
        return 2.0 * (nranks - 1) / nranks
    if op in ("broadcast", "exchange"):
        return 1.0
    raise ValueError(f"no bus factor for op {op!r}; known: {', '.join(OPS)}")


def bandwidths(size_bytes: int, seconds: float, op: str, nranks: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes/s) of one ``op`` on ``size_bytes`` in ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"time must be > 0, got {seconds}")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, nranks)


def plan_iters(est_seconds: float, max_iters: int, min_iters: int, budget_s: float) -> int:
    """Timed iterations for an op that takes ``est_seconds``.

    As many as fit in ``budget_s``, at most ``max_iters`` and at least ``min_iters`` (or
    ``max_iters`` when that is smaller).
    """
    low = min(min_iters, max_iters)
    if est_seconds <= 0:
        return max_iters
    return max(low, min(max_iters, int(budget_s / est_seconds)))


def inside_mpi(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started as a rank by an MPI launcher (mpirun, srun, hydra)."""
    env = os.environ if env is None else env
    return any(name in env for name in _MPI_ENV)


def default_json_path(now: float | None = None) -> Path:
    """``bench-results/comm-<timestamp>.json`` relative to the working directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("bench-results") / f"comm-{stamp}.json"


# ---------------------------------------------------------------------------- report
def _mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(rows: Sequence[Mapping[str, Any]], layout: str,
              device: str = "cpu") -> dict[str, Any]:
    """The headline figures of a run (one JSON line on stdout).

    ``ratio`` is hadpsgd's busbw over raw mpi4py's for the same op and size (> 1: hadpsgd is
    faster); a latency ratio is hadpsgd's time over mpi4py's (> 1: hadpsgd adds latency).
    Means are arithmetic means over the sizes of the class (>= 1 MiB, <= 1 KiB).

    With ``device="cuda"`` the mpi4py baseline is the one with the host copies, and the
    ratios against mpi4py on the device buffers (CUDA-aware MPI only) are added as
    ``device_*`` keys; on CPU the summary has exactly the keys it always had.
    """

    def select(name: str, small: bool) -> list[Mapping[str, Any]]:
        return [r for r in rows if r["name"] == name
                and (r["size_bytes"] <= KIB if small else r["size_bytes"] >= MIB)]

    def big_ratio(name: str, key: str = "ratio") -> float | None:
        return _mean([r[key] for r in select(name, False) if r.get(key) is not None])

    def latency(name: str) -> float | None:
        return _mean([r["time_us"] / r["mpi4py_time_us"] for r in select(name, True)])

    per_op: dict[str, dict[str, float | None]] = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        entry = {"busbw_ratio_ge_1MiB": big_ratio(name), "latency_ratio_le_1KiB": latency(name)}
        if any(r.get("gloo_ratio") is not None for r in rows if r["name"] == name):
            entry["gloo_busbw_ratio_ge_1MiB"] = big_ratio(name, "gloo_ratio")
        if any(r.get("device_ratio") is not None for r in rows if r["name"] == name):
            entry["device_busbw_ratio_ge_1MiB"] = big_ratio(name, "device_ratio")
        per_op[name] = entry
    summary: dict[str, Any] = {
        "benchmark": "comm",
        "layout": layout,
        "allreduce_flat_ratio_ge_1MiB": big_ratio("allreduce/flat"),
        "allreduce_hier_ratio_ge_1MiB": big_ratio("allreduce/hier"),
        "allreduce_flat_latency_ratio_le_1KiB": latency("allreduce/flat"),
        "allreduce_hier_latency_ratio_le_1KiB": latency("allreduce/hier"),
        "allreduce_flat_gloo_ratio_ge_1MiB": big_ratio("allreduce/flat", "gloo_ratio"),
        "per_op": per_op,
    }
    if device != "cpu":
        summary["device"] = device
        summary["allreduce_flat_device_ratio_ge_1MiB"] = big_ratio("allreduce/flat",
                                                                   "device_ratio")
    intra = compare_backends(rows)
    if intra:
        summary["intra_gloo_vs_mpi"] = intra
    return summary


def compare_backends(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The gloo intra-node backend against mpi, for each op measured with both intra-node backends.

    For every op (``intra``, ``allreduce/hier``): the mean of gloo's time over mpi's at
    <= 1 KiB and at >= 1 MiB (> 1: mpi is faster), and at how many sizes each one won.
    """
    by_key: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        if r.get("backend") in INTRA_CHOICES and r["op"] in ("intra", "allreduce"):
            key = (f"{r['op']}/{r['path']}" if r["op"] == "allreduce" else r["op"],
                   r["size_bytes"])
            by_key.setdefault(key, {})[r["backend"]] = r["time_us"]
    out: dict[str, Any] = {}
    for op in dict.fromkeys(k[0] for k in by_key):
        pairs = [(size, t) for (o, size), t in by_key.items() if o == op and len(t) == 2]
        if not pairs:
            continue
        ratio = {size: t["gloo"] / t["mpi"] for size, t in pairs}
        out[op] = {
            "gloo_over_mpi_time_le_1KiB": _mean([v for s, v in ratio.items() if s <= KIB]),
            "gloo_over_mpi_time_ge_1MiB": _mean([v for s, v in ratio.items() if s >= MIB]),
            "mpi_faster_sizes": sum(v > 1 for v in ratio.values()),
            "gloo_faster_sizes": sum(v < 1 for v in ratio.values()),
            "sizes": len(ratio),
        }
    return out


def intra_view_names(device: str, own: str,
                     requested: Sequence[str]) -> tuple[list[str], list[str]]:
    """The intra-node backends the ``intra`` op measures, and notes on those it skips.

    On CPU these are the ``requested`` ones (``--intra-backends``). On CUDA the backend the
    topology gives device tensors (``own``: ``nccl``, or the host backend they are staged
    through) always runs, with ``mpi`` (device tensors staged through host MPI) when asked
    for; gloo is a view of host tensors, so it is skipped with a note.

    Args:
        device: ``cpu`` or ``cuda``.
        own: ``Topology.intra_backend`` of the run.
        requested: The backends ``--intra-backends`` named.
    """
    if device == "cpu":
        return list(requested), []
    names = [own, *(n for n in requested if n == "mpi" and n != own)]
    notes = []
    if "gloo" in requested and own != "gloo":
        notes.append(f"intra/gloo skipped on {device}: gloo's view is of host tensors; device "
                     f"tensors take {own}")
    return names, notes


def _num(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


_BASELINE_COLUMNS = {
    # device: (first baseline's column, second baseline's column, the second's row keys)
    "cpu": ("mpi4py", "gloo", ("gloo_time_us", "gloo_ratio")),
    # mpi4py+cp: raw mpi4py with the user's copies to and from pinned host memory;
    # mpi4py-dev: raw mpi4py handed the device tensor (only where MPI is CUDA-aware).
    "cuda": ("mpi4py+cp", "mpi4py-dev", ("mpi4py_device_time_us", "device_ratio")),
}


def table_header(device: str = "cpu") -> str:
    """Two header lines of the stdout table (nccl-tests layout) for buffers on ``device``.

    The two baseline columns are raw mpi4py and gloo on CPU; on CUDA raw mpi4py with host
    copies and raw mpi4py on the device buffers.
    """
    first, second, _ = _BASELINE_COLUMNS[device]
    return (f"#{'size':>11} {'count':>10}  {'op':<20} {'time':>10} {'algbw':>8} {'busbw':>8} "
            f"{first:>10} {'ratio':>6} {second:>10} {'ratio':>6}\n"
            f"#{'(B)':>11} {'(elems)':>10}  {'':<20} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} "
            f"{'(us)':>10} {'':>6} {'(us)':>10} {'':>6}")


TABLE_HEADER = table_header("cpu")
"""Two header lines of the stdout table on CPU (see :func:`table_header`)."""


def format_row(row: Mapping[str, Any], device: str = "cpu") -> str:
    """One line of the stdout table for a result row measured on ``device``."""
    _, _, (second_us, second_ratio) = _BASELINE_COLUMNS[device]
    return (f" {row['size_bytes']:>11} {row['count']:>10}  {row['name']:<20} "
            f"{_num(row['time_us'], '.1f', 10)} {_num(row['algbw_gbps'], '.3f', 8)} "
            f"{_num(row['busbw_gbps'], '.3f', 8)} {_num(row.get('mpi4py_time_us'), '.1f', 10)} "
            f"{_num(row.get('ratio'), '.2f', 6)} {_num(row.get(second_us), '.1f', 10)} "
            f"{_num(row.get(second_ratio), '.2f', 6)}")


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
    from hadpsgd.launch import LauncherError, launch_env, mpirun_command

    nprocs = a.nprocs or 4
    json_path = a.json or default_json_path()
    try:
        cmd = mpirun_command(nprocs, worker_argv(a, json_path), module="benchmarks.comm")
    except LauncherError as err:
        print(f"benchmarks.comm: {err}", file=sys.stderr)
        return 2
    env = launch_env(nprocs=nprocs)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if a.ranks_per_node is not None:
        env["HADPSGD_RANKS_PER_NODE"] = str(a.ranks_per_node)
    print("# " + " ".join(cmd), flush=True)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: launch the ranks, or be one."""
    a = parse_args(argv)
    from benchmarks._launch import cuda_missing

    if cuda_missing("benchmarks.comm", a.device):
        return 2
    if a.no_launch or inside_mpi():
        from benchmarks._comm_worker import run

        return run(a)
    return launch(a)


if __name__ == "__main__":
    sys.exit(main())
