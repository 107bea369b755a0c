"""The sweep of ``python -m benchmarks.comm`` on one rank: every op at every size, timed alike.

Every rank runs the same sequence of cases (an op variant at one message size). A case is run
once on rank-dependent data and checked, then warmed up and timed with the shared harness
(:mod:`benchmarks._common.timing`); the iteration counts come from times agreed over all
ranks (MAX), so every rank runs the same number of collectives. Each case becomes a result
row with its bandwidths and its ratios to the baselines measured in the same run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from benchmarks._common.timing import device_sync, seconds_per_step
from benchmarks.comm.cases import BenchError, Case, Cases
from benchmarks.comm.report import ELEMENT_BYTES, bandwidths, bus_factor, format_size, plan_iters
from hadpsgd.comm import Topology


@dataclass
class Timing:
    """The result of timing one case: max over ranks of the per-op average, and iterations."""

    seconds: float
    iters: int


class Timer:
    """Times cases identically on every rank of ``comm``.

    Args:
        comm: The world communicator (every rank takes part in every case).
        mpi: The ``mpi4py.MPI`` module.
        opts: Parsed options (``iters``, ``warmup``, ``min_iters``, ``max_time``).
        device: Where the cases' tensors live; on CUDA the device is synchronized before
            each reading of the clock.
    """

    def __init__(self, comm: Any, mpi: Any, opts: argparse.Namespace,
                 device: torch.device | None = None) -> None:
        self.comm = comm
        self.mpi = mpi
        self.iters = opts.iters
        self.warmup = opts.warmup
        self.min_iters = opts.min_iters
        self.budget = opts.max_time
        self.sync = device_sync(device)

    def _max(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.mpi.MAX))

    def _loop(self, run: Callable[[], None], iters: int) -> float:
        """Seconds per op of ``iters`` back-to-back runs after a barrier, max over ranks."""
        # Kernels still queued (filling the buffers, an earlier case) must not be billed to
        # this loop, and the ops' own queued work must be: GPU calls return before they end.
        # The harness synchronizes before each reading of the clock for that.
        return self._max(seconds_per_step(run, iters, sync=self.sync, barrier=self.comm.Barrier))

    def time(self, case: Case, size_bytes: int) -> Timing:
        """Check ``case`` once, warm it up, time it.

        Raises:
            BenchError: If any rank's checked result is wrong (naming the ranks).
        """
        case.fill()
        first = self._loop(case.run, 1)  # also the first warm-up op
        bad = [r for r, ok in enumerate(self.comm.allgather(bool(case.verify()))) if not ok]
        if bad:
            raise BenchError(f"{case.label} at {format_size(size_bytes)} gave a wrong result on "
                             f"rank(s) {', '.join(map(str, bad))}")
        case.reset()
        est = first
        warm = min(self.warmup - 1, int(0.25 * self.budget / max(est, 1e-9)))
        if warm > 0:
            est = self._loop(case.run, warm)
        iters = plan_iters(est, self.iters, self.min_iters, self.budget)
        return Timing(self._loop(case.run, iters), iters)


# ---------------------------------------------------------------------------- rows and sweep
def _row(op: str, path: str | None, backend: str | None, name: str, size: int, nranks: int,
         t: Timing, base: Timing | None, gloo: Timing | None) -> dict[str, Any]:
    algbw, busbw = bandwidths(size, t.seconds, op, nranks)
    row: dict[str, Any] = {
        "op": op, "path": path, "backend": backend, "name": name, "size_bytes": size,
        "count": size // ELEMENT_BYTES, "dtype": "float32", "nranks": nranks,
        "bus_factor": bus_factor(op, nranks), "iters": t.iters, "time_us": t.seconds * 1e6,
        "algbw_gbps": algbw, "busbw_gbps": busbw,
        "mpi4py_time_us": None, "mpi4py_iters": None, "mpi4py_busbw_gbps": None, "ratio": None,
        "gloo_time_us": None, "gloo_iters": None, "gloo_busbw_gbps": None, "gloo_ratio": None,
    }
    for key, ref in (("mpi4py", base), ("gloo", gloo)):
        if ref is None:
            continue
        row[f"{key}_time_us"] = ref.seconds * 1e6
        row[f"{key}_iters"] = ref.iters
        row[f"{key}_busbw_gbps"] = bandwidths(size, ref.seconds, op, nranks)[1]
        # = busbw / baseline busbw (same factor); also defined when the factor is 0 (n = 1)
        row["ratio" if key == "mpi4py" else "gloo_ratio"] = ref.seconds / t.seconds
    return row


def _device_keys(size: int, op: str, nranks: int, t: Timing, direct: Timing | None,
                 route: dict[str, str] | None) -> dict[str, Any]:
    """The keys a row measured on CUDA adds: the baseline on device buffers, and the route.

    ``mpi4py_*`` / ``ratio`` of such a row are the baseline through host copies;
    ``mpi4py_device_*`` / ``device_ratio`` the one on the device buffers (``None`` unless MPI
    is CUDA-aware); ``route`` is ``Topology.route`` of the measured tensor (reductions only).
    """
    keys: dict[str, Any] = {"mpi4py_device_time_us": None, "mpi4py_device_iters": None,
                            "mpi4py_device_busbw_gbps": None, "device_ratio": None,
                            "route": route}
    if direct is not None:
        keys.update(mpi4py_device_time_us=direct.seconds * 1e6,
                    mpi4py_device_iters=direct.iters,
                    mpi4py_device_busbw_gbps=bandwidths(size, direct.seconds, op, nranks)[1],
                    device_ratio=direct.seconds / t.seconds)
    return keys


def route_record(view: Topology) -> dict[str, str]:
    """``view.route`` of the float32 tensors the cases reduce, as a JSON object."""
    return view.route(torch.empty(0, dtype=torch.float32, device=view.device))._asdict()


def sweep(a: argparse.Namespace, topo: Topology, mpi: Any, gloo: Any | None,
          views: dict[str, Topology]) -> Iterator[dict[str, Any]]:
    """Yield the result rows, op by op and size by size.

    On CUDA every row gets :func:`_device_keys`; with a CUDA-aware MPI each baseline is also
    measured on the device buffers.
    """
    timer = Timer(topo.comm, mpi, a, topo.device)
    cases = Cases(topo, mpi, gloo)
    gpu = cases.on_gpu
    direct = gpu and topo.cuda_aware
    hier = topo.num_nodes > 1 and max(topo.node_sizes) > 1
    n, local_n = topo.size, max(topo.node_sizes)
    for op in a.op:
        for size in a.sizes:
            count = size // ELEMENT_BYTES

            def measure(case: Case, size: int = size) -> Timing:
                return timer.time(case, size)  # the cases of a size share their buffers

            def baseline(make: Callable[..., Case]) -> tuple[Timing, Timing | None]:
                """The mpi4py baseline (through host copies on CUDA), and on device buffers."""
                return (measure(make(direct=False)),
                        measure(make(direct=True)) if direct else None)

            def row(op: str, path: str | None, backend: str | None, name: str, nranks: int,
                    t: Timing, base: tuple[Timing, Timing | None], ref: Timing | None = None,
                    view: Topology | None = None, size: int = size) -> dict[str, Any]:
                out = _row(op, path, backend, name, size, nranks, t, base[0], ref)
                if gpu:  # CPU rows keep exactly the keys they always had
                    out.update(_device_keys(size, op, nranks, t, base[1],
                                            route_record(view) if view is not None else None))
                return out

            if op == "allreduce":
                base = baseline(partial(cases.mpi_allreduce, count))
                ref = measure(cases.gloo_allreduce(count)) if gloo is not None else None
                for path in ("flat", "hier") if hier else ("flat",):
                    t = measure(cases.allreduce(topo, path, count))
                    yield row(op, path, None, f"allreduce/{path}", n, t, base, ref, topo)
            elif op == "broadcast":
                base = baseline(partial(cases.mpi_bcast, count))
                t = measure(cases.broadcast(count))
                yield row(op, None, None, "broadcast", n, t, base)
            elif op == "exchange":
                base = baseline(partial(cases.mpi_sendrecv, count))
                t = measure(cases.exchange(count))
                yield row(op, None, None, "exchange", 2, t, base)
            elif op == "intra":
                base = baseline(partial(cases.mpi_allreduce, count, intra=True))
                for name, view in views.items():
                    t = measure(cases.intra(view, count))
                    yield row(op, None, name, f"intra/{name}", local_n, t, base, view=view)
                if hier:
                    base = baseline(partial(cases.mpi_allreduce, count))
                    for name, view in views.items():
                        t = measure(cases.allreduce(view, "hier", count))
                        yield row("allreduce", "hier", name, f"allreduce/hier[{name}]", n, t,
                                  base, view=view)

