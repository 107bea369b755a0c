"""The ranks' side of ``python -m benchmarks.comm``: build each case, time it, report.

Every rank runs the same sequence of cases (an op variant at one message size). A case is
run once on rank-dependent data and checked, then warmed up and timed; the iteration counts
come from times agreed over all ranks (MAX), so every rank runs the same number of
collectives. Rank 0 prints the table as it goes, writes the JSON file and the summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.comm import (
    ELEMENT_BYTES,
    TABLE_HEADER,
    bandwidths,
    bus_factor,
    default_json_path,
    format_row,
    format_size,
    plan_iters,
    summarize,
)
from hadpsgd import comm as hcomm
from hadpsgd.comm import Topology
from hadpsgd.comm.flat import zeros as flat_zeros
from hadpsgd.comm.hierarchical import Path as ReducePath

Buffer = Any
"""A float32 CPU torch tensor or NumPy array (both accept ``buf[...] = v`` and ``==``)."""


class BenchError(RuntimeError):
    """A case produced a wrong result, or the benchmark cannot run on this layout."""


def _nothing() -> None:
    return None


@dataclass
class Case:
    """One variant of an op at one size: how to run it once, and how to check one result.

    Attributes:
        label: Name for messages (``hadpsgd allreduce/flat``, ``mpi4py Bcast``...).
        run: One operation (the timed unit).
        fill: Put rank-dependent data in the buffers before the checked run.
        verify: After one run on filled data: whether this rank's result is right.
        reset: After the check: data for the timed runs (zeros, so repeated sums stay finite).
    """

    label: str
    run: Callable[[], None]
    fill: Callable[[], None]
    verify: Callable[[], bool]
    reset: Callable[[], None] = _nothing


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
    """

    def __init__(self, comm: Any, mpi: Any, opts: argparse.Namespace) -> None:
        self.comm = comm
        self.mpi = mpi
        self.iters = opts.iters
        self.warmup = opts.warmup
        self.min_iters = opts.min_iters
        self.budget = opts.max_time

    def _max(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.mpi.MAX))

    def _loop(self, run: Callable[[], None], iters: int) -> float:
        """Seconds per op of ``iters`` back-to-back runs after a barrier, max over ranks."""
        self.comm.Barrier()
        tic = time.perf_counter()
        for _ in range(iters):
            run()
        return self._max((time.perf_counter() - tic) / iters)

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


class Cases:
    """Builds the cases of every op for one layout.

    Args:
        topo: The hadpsgd topology.
        mpi: The ``mpi4py.MPI`` module.
        gloo: A gloo process group over the world, or ``None`` to skip that baseline.
    """

    def __init__(self, topo: Topology, mpi: Any, gloo: Any | None) -> None:
        self.topo = topo
        self.mpi = mpi
        self.gloo = gloo
        self.value = float(topo.rank + 1)
        n = topo.size
        self.world_sum = n * (n + 1) / 2
        self.node_sum = float(sum(topo.node_ranks) + topo.local_size)
        self.peer = topo.rank ^ 1 if (topo.rank ^ 1) < n else None

    @staticmethod
    def _buffer(count: int, numpy: bool) -> Buffer:
        # hadpsgd's own flat buffers come from hadpsgd.comm.flat.zeros (NumPy-allocated host
        # memory); benchmark the collectives on the same kind of buffer.
        return np.empty(count, dtype=np.float32) if numpy else flat_zeros(count)

    def _reduction(self, label: str, count: int, expected: float, op: Callable[[Buffer], None],
                   numpy: bool = False) -> Case:
        buf = self._buffer(count, numpy)

        def fill() -> None:
            buf[...] = self.value

        def reset() -> None:
            buf[...] = 0

        return Case(label, lambda: op(buf), fill, lambda: bool((buf == expected).all()), reset)

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, view: Topology, path: ReducePath, count: int) -> Case:
        """``Topology.allreduce_`` (sum) over the world on ``path`` with ``view``'s backend."""
        return self._reduction(f"hadpsgd allreduce/{path} ({view.intra_backend})", count,
                               self.world_sum,
                               lambda t: view.allreduce_(t, op="sum", path=path))

    def intra(self, view: Topology, count: int) -> Case:
        """``Topology.intra_allreduce_`` (sum) with ``view``'s intra-node backend."""
        return self._reduction(f"hadpsgd intra_allreduce_ ({view.intra_backend})", count,
                               self.node_sum, lambda t: view.intra_allreduce_(t, op="sum"))

    def mpi_allreduce(self, count: int, intra: bool = False) -> Case:
        """Raw ``Allreduce(IN_PLACE, SUM)`` on the world (or the node) communicator."""
        comm = self.topo.intra if intra else self.topo.comm
        mpi = self.mpi
        return self._reduction("mpi4py Allreduce" + (" (node)" if intra else ""), count,
                               self.node_sum if intra else self.world_sum,
                               lambda a: comm.Allreduce(mpi.IN_PLACE, a, op=mpi.SUM), numpy=True)

    def gloo_allreduce(self, count: int) -> Case:
        """torch.distributed gloo ``allreduce`` (sum) over the world."""
        pg = self.gloo
        return self._reduction("gloo allreduce", count, self.world_sum,
                               lambda t: pg.allreduce([t]).wait())

    # ------------------------------------------------------------------ broadcast
    def _bcast(self, label: str, count: int, op: Callable[[Buffer], None], numpy: bool) -> Case:
        buf = self._buffer(count, numpy)

        def fill() -> None:
            buf[...] = self.value

        return Case(label, lambda: op(buf), fill, lambda: bool((buf == 1.0).all()))

    def broadcast(self, count: int) -> Case:
        """``Topology.broadcast_`` from rank 0."""
        return self._bcast("hadpsgd broadcast_", count, lambda t: self.topo.broadcast_(t, 0),
                           numpy=False)

    def mpi_bcast(self, count: int) -> Case:
        """Raw ``Bcast`` from rank 0."""
        world = self.topo.comm
        return self._bcast("mpi4py Bcast", count, lambda a: world.Bcast(a, root=0), numpy=True)

    # ------------------------------------------------------------------ pair exchange
    def _pair(self, label: str, count: int, op: Callable[[Buffer, Buffer, int], None],
              numpy: bool) -> Case:
        send, recv = self._buffer(count, numpy), self._buffer(count, numpy)
        peer = self.peer

        def fill() -> None:
            send[...] = self.value
            recv[...] = 0

        if peer is None:  # the odd rank out of an odd world idles
            return Case(label, _nothing, _nothing, lambda: True)
        return Case(label, lambda: op(send, recv, peer), fill,
                    lambda: bool((recv == float(peer + 1)).all()))

    def exchange(self, count: int) -> Case:
        """``Topology.exchange`` with the even/odd partner."""
        return self._pair("hadpsgd exchange", count,
                          lambda s, r, p: self.topo.exchange(s, r, p, tag=0), numpy=False)

    def mpi_sendrecv(self, count: int) -> Case:
        """Raw ``Sendrecv`` with the even/odd partner."""
        world = self.topo.comm

        def op(s: np.ndarray, r: np.ndarray, p: int) -> None:
            world.Sendrecv(s, dest=p, sendtag=0, recvbuf=r, source=p, recvtag=0)

        return self._pair("mpi4py Sendrecv", count, op, numpy=True)


# ---------------------------------------------------------------------------- set-up
def backend_views(topo: Topology, names: list[str]) -> dict[str, Topology]:
    """A topology per intra-node backend, sharing everything else with ``topo``.

    ``init`` builds one backend; for the others the same communicators get a new backend and
    a reducer around it, so the public ``intra_allreduce_`` / ``allreduce_`` are measured.
    """
    from hadpsgd.comm.backends import GlooIntra, MPIIntra
    from hadpsgd.comm.hierarchical import Reducer

    classes = {"mpi": MPIIntra, "gloo": GlooIntra}
    views: dict[str, Topology] = {}
    for name in names:
        if name == topo.intra_backend:
            views[name] = topo
            continue
        backend = classes[name](topo.intra, topo.watchdog, topo.node_ranks)
        reducer = Reducer(topo.comm, topo.inter, backend, topo.watchdog, topo.inter_ranks,
                          topo.node_sizes, topo.reducer.bucket_bytes, topo.reducer.algo,
                          topo.cuda_aware)
        views[name] = dataclasses.replace(topo, reducer=reducer, _backend=backend,
                                          intra_backend=name)
    return views


def gloo_world(topo: Topology, store_dir: str) -> tuple[Any, str]:
    """A gloo process group over all ranks, rendezvous through a FileStore in ``store_dir``.

    The file's path is chosen by rank 0 and broadcast over MPI (no TCP store, no env).
    """
    import torch.distributed as dist

    path = None
    if topo.rank == 0:
        os.makedirs(store_dir, exist_ok=True)
        path = os.path.join(store_dir, f"hadpsgd-bench-gloo-{uuid.uuid4().hex}")
    path = topo.comm.bcast(path, root=0)
    store = dist.FileStore(path, topo.size)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), topo.rank, topo.size,
                               datetime.timedelta(seconds=topo.timeout))
    return pg, path


def _mpi_name(mpi: Any) -> str:
    """The MPI library's name and version, e.g. ``Open MPI v5.0.11``."""
    text = mpi.Get_library_version().replace("\x00", "").strip()
    return text.splitlines()[0].split(",")[0].strip() if text else "unknown"


def _mpi4py_version() -> str:
    import mpi4py

    return str(mpi4py.__version__)


def _count_hosts(topo: Topology, mpi: Any) -> int:
    host = topo.comm.Split_type(mpi.COMM_TYPE_SHARED, key=topo.rank)
    leaders = int(topo.comm.allreduce(int(host.Get_rank() == 0), op=mpi.SUM))
    host.Free()
    return leaders


# ---------------------------------------------------------------------------- the sweep
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


def sweep(a: argparse.Namespace, topo: Topology, mpi: Any, gloo: Any | None,
          views: dict[str, Topology]) -> Iterator[dict[str, Any]]:
    """Yield the result rows, op by op and size by size."""
    timer = Timer(topo.comm, mpi, a)
    cases = Cases(topo, mpi, gloo)
    hier = topo.num_nodes > 1 and max(topo.node_sizes) > 1
    n, local_n = topo.size, max(topo.node_sizes)
    for op in a.op:
        for size in a.sizes:
            count = size // ELEMENT_BYTES

            def measure(case: Case, size: int = size) -> Timing:
                return timer.time(case, size)  # the case (its buffers) is dropped afterwards

            if op == "allreduce":
                base = measure(cases.mpi_allreduce(count))
                ref = measure(cases.gloo_allreduce(count)) if gloo is not None else None
                for path in ("flat", "hier") if hier else ("flat",):
                    t = measure(cases.allreduce(topo, path, count))
                    yield _row(op, path, None, f"allreduce/{path}", size, n, t, base, ref)
            elif op == "broadcast":
                base = measure(cases.mpi_bcast(count))
                t = measure(cases.broadcast(count))
                yield _row(op, None, None, "broadcast", size, n, t, base, None)
            elif op == "exchange":
                base = measure(cases.mpi_sendrecv(count))
                t = measure(cases.exchange(count))
                yield _row(op, None, None, "exchange", size, 2, t, base, None)
            elif op == "intra":
                base = measure(cases.mpi_allreduce(count, intra=True))
                for name, view in views.items():
                    t = measure(cases.intra(view, count))
                    yield _row(op, None, name, f"intra/{name}", size, local_n, t, base, None)
                if hier:
                    base = measure(cases.mpi_allreduce(count))
                    for name, view in views.items():
                        t = measure(cases.allreduce(view, "hier", count))
                        yield _row("allreduce", "hier", name, f"allreduce/hier[{name}]", size,
                                   n, t, base, None)


def _usable_ops(a: argparse.Namespace, topo: Topology) -> tuple[list[str], list[str]]:
    ops, notes = [], []
    for op in a.op:
        if op == "exchange" and topo.size < 2:
            notes.append("exchange skipped: it needs at least 2 ranks")
        elif op == "intra" and max(topo.node_sizes) < 2:
            notes.append("intra skipped: every node holds a single rank")
        else:
            ops.append(op)
    return ops, notes


def run(a: argparse.Namespace) -> int:
    """Run the benchmark as one rank of the current MPI job; rank 0 reports. Exit code."""
    topo = hcomm.init(ranks_per_node=a.ranks_per_node, device="cpu",
                      intra_backend=a.intra_backend, hier_algo=a.hier_algo,
                      bucket_mb=a.bucket_mb)
    mpi = topo._mpi
    try:
        return _run(a, topo, mpi)
    except Exception:  # one failing rank would leave the others blocked in a collective
        sys.stderr.write(f"benchmarks.comm: rank {topo.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        topo.abort(1)
        return 1


def _run(a: argparse.Namespace, topo: Topology, mpi: Any) -> int:
    root = topo.rank == 0

    def say(text: str) -> None:
        if root:
            print(text, flush=True)

    hosts = _count_hosts(topo, mpi)
    json_path = Path(topo.comm.bcast(str(a.json or default_json_path()) if root else None))
    a.op, notes = _usable_ops(a, topo)
    gloo, store = None, None
    if "allreduce" in a.op and not a.no_gloo:
        store_dir = a.gloo_dir or (str(json_path.parent) if hosts > 1 else tempfile.gettempdir())
        gloo, store = gloo_world(topo, store_dir)
    views = backend_views(topo, a.intra_backends) if "intra" in a.op else {}

    say(f"# hadpsgd.comm microbenchmark: {topo.describe()}")
    say(f"# {hosts} host(s), {os.cpu_count()} CPUs on rank 0's host, MPI: "
        f"{_mpi_name(mpi)}, torch {torch.__version__}")
    say(f"# ops {' '.join(a.op)}, {format_size(a.sizes[0])} .. {format_size(a.sizes[-1])} "
        f"float32, iters <= {a.iters} (>= {a.min_iters}, ~{a.max_time:g} s per measurement), "
        f"warmup <= {a.warmup}; time = max over ranks of the mean per op")
    say("# ratio = hadpsgd busbw / baseline busbw (= baseline time / hadpsgd time; > 1: "
        "hadpsgd faster)")
    for note in notes:
        say(f"# {note}")
    say(TABLE_HEADER)
    started = time.time()
    rows = []
    for row in sweep(a, topo, mpi, gloo, views):
        rows.append(row)
        say(format_row(row))
    elapsed = time.time() - started

    for view in views.values():
        if view is not topo:
            view.close()
    topo.comm.Barrier()
    if store and root and os.path.exists(store):
        try:
            os.unlink(store)
        except OSError:
            pass
    if root:
        summary = summarize(rows, topo.describe())
        summary["json"] = str(json_path)
        summary["seconds"] = round(elapsed, 1)
        record = {
            "benchmark": "comm",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "argv": sys.argv,
            "layout": topo.describe(),
            "topology": {"size": topo.size, "num_nodes": topo.num_nodes,
                         "node_sizes": topo.node_sizes, "emulated": topo.emulated,
                         "hosts": hosts, "intra_backend": topo.intra_backend,
                         "hier_algo": topo.reducer.algo,
                         "bucket_bytes": topo.reducer.bucket_bytes},
            "options": {"ops": a.op, "sizes": a.sizes, "iters": a.iters, "warmup": a.warmup,
                        "min_iters": a.min_iters, "max_time": a.max_time,
                        "gloo": gloo is not None, "intra_backends": list(views)},
            "env": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "numpy": np.__version__,
                    "mpi": _mpi_name(mpi), "mpi4py": _mpi4py_version(),
                    "host": platform.node()},
            "seconds": elapsed,
            "rows": rows,
            "summary": summary,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"# wrote {json_path}", flush=True)
        print(json.dumps(summary), flush=True)
    topo.close()
    return 0
