"""The driver-side arithmetic of ``python -m benchmarks.comm``: sizes, bandwidths, table, summary.

Nothing here imports MPI or torch: the driver, the ranks (:mod:`benchmarks.comm.worker`) and the
tests share these helpers. Bandwidths follow nccl-tests: ``algbw`` is bytes over time, ``busbw``
is that times the op's bus factor (what the busiest link carries).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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

