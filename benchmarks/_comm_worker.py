"""The ranks' side of ``python -m benchmarks.comm``: build each case, time it, report.

Every rank runs the same sequence of cases (an op variant at one message size). A case is
run once on rank-dependent data and checked, then warmed up and timed; the iteration counts
come from times agreed over all ranks (MAX), so every rank runs the same number of
collectives. Rank 0 prints the table as it goes, writes the JSON file and the summary line.

With ``--device cuda`` the hadpsgd cases work on CUDA tensors and the raw mpi4py baselines on
the same device tensors, through the copies a user would write (and directly where MPI is
CUDA-aware); the clock is read only after the device is synchronized.
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._launch import file_store, remove_store
from benchmarks.comm import (
    ELEMENT_BYTES,
    bandwidths,
    bus_factor,
    default_json_path,
    format_row,
    format_size,
    intra_view_names,
    plan_iters,
    summarize,
    table_header,
)
from hadpsgd import comm as hcomm
from hadpsgd.comm import Topology
from hadpsgd.comm.flat import zeros as flat_zeros
from hadpsgd.comm.hierarchical import Path as ReducePath

Buffer = Any
"""A float32 torch tensor (CPU or CUDA) or NumPy array (all accept ``buf[...] = v``, ``==``)."""


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
        self.sync: Callable[[], None] = _nothing
        if device is not None and device.type == "cuda":
            self.sync = lambda: torch.cuda.synchronize(device)

    def _max(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.mpi.MAX))

    def _loop(self, run: Callable[[], None], iters: int) -> float:
        """Seconds per op of ``iters`` back-to-back runs after a barrier, max over ranks."""
        # Kernels still queued (filling the buffers, an earlier case) must not be billed to
        # this loop, and the ops' own queued work must be: GPU calls return before they end.
        self.sync()
        self.comm.Barrier()
        tic = time.perf_counter()
        for _ in range(iters):
            run()
        self.sync()
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

    The buffers live on the topology's device. The raw mpi4py baselines (``raw`` buffers)
    are NumPy arrays on CPU; on CUDA they are device tensors handed to MPI through
    :meth:`_raw`, with the host copies (``direct=False``) or as they are (``direct=True``,
    CUDA-aware MPI only).

    Args:
        topo: The hadpsgd topology.
        mpi: The ``mpi4py.MPI`` module.
        gloo: A gloo process group over the world, or ``None`` to skip that baseline.
    """

    def __init__(self, topo: Topology, mpi: Any, gloo: Any | None) -> None:
        self.topo = topo
        self.mpi = mpi
        self.gloo = gloo
        self.device = topo.device
        self.on_gpu = topo.device.type == "cuda"
        self.value = float(topo.rank + 1)
        n = topo.size
        self.world_sum = n * (n + 1) / 2
        self.node_sum = float(sum(topo.node_ranks) + topo.local_size)
        self.peer = topo.rank ^ 1 if (topo.rank ^ 1) < n else None

    def _buffer(self, count: int, raw: bool) -> Buffer:
        if raw and not self.on_gpu:
            return np.empty(count, dtype=np.float32)
        # hadpsgd's own flat buffers come from hadpsgd.comm.flat.zeros (NumPy-allocated host
        # memory on CPU); benchmark the collectives on the same kind of buffer.
        return flat_zeros(count, torch.float32, self.device)

    def _variant(self, direct: bool) -> str:
        if not self.on_gpu:
            return ""
        return " (device buffers)" if direct else " (host copies)"

    def _raw(self, call: Callable[..., None], count: int, direct: bool, nbufs: int = 1,
             inputs: Sequence[int] = (0,), outputs: Sequence[int] = (0,)) -> Callable[..., None]:
        """Raw mpi4py ``call`` on the case's buffers, written as a user would for them.

        On CPU ``call`` receives the NumPy buffers themselves. On CUDA with ``direct`` it
        receives the device tensors once the stream has finished writing them (CUDA-aware
        MPI reads device memory itself). Otherwise the ``inputs`` are copied into pinned host
        tensors allocated once here, ``call`` works on their NumPy views, the ``outputs`` are
        copied back and the stream synchronized: the copies are part of the time.

        Args:
            call: The MPI call on ``nbufs`` buffers.
            count: Elements per buffer.
            direct: Hand MPI the device tensors (CUDA only).
            nbufs: Buffers of the case.
            inputs: Which buffers MPI reads (copied to the host first).
            outputs: Which buffers MPI writes (copied back to the device after).
        """
        if not self.on_gpu:
            return call
        stream = torch.cuda.current_stream(self.device)
        if direct:
            def on_device(*bufs: torch.Tensor) -> None:
                stream.synchronize()  # MPI does not order itself after queued kernels
                call(*bufs)

            return on_device
        hosts = [torch.empty(count, dtype=torch.float32, pin_memory=True) for _ in range(nbufs)]
        arrays = [h.numpy() for h in hosts]

        def through_host(*bufs: torch.Tensor) -> None:
            for i in inputs:
                hosts[i].copy_(bufs[i])
            call(*arrays)
            for i in outputs:
                bufs[i].copy_(hosts[i])
            stream.synchronize()

        return through_host

    def _reduction(self, label: str, count: int, expected: float, op: Callable[[Buffer], None],
                   raw: bool = False) -> Case:
        buf = self._buffer(count, raw)

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

    def mpi_allreduce(self, count: int, intra: bool = False, direct: bool = False) -> Case:
        """Raw ``Allreduce(IN_PLACE, SUM)`` on the world (or the node) communicator."""
        comm = self.topo.intra if intra else self.topo.comm
        mpi = self.mpi
        call = self._raw(lambda a: comm.Allreduce(mpi.IN_PLACE, a, op=mpi.SUM), count, direct)
        return self._reduction("mpi4py Allreduce" + (" (node)" if intra else "")
                               + self._variant(direct), count,
                               self.node_sum if intra else self.world_sum, call, raw=True)

    def gloo_allreduce(self, count: int) -> Case:
        """torch.distributed gloo ``allreduce`` (sum) over the world."""
        pg = self.gloo
        return self._reduction("gloo allreduce", count, self.world_sum,
                               lambda t: pg.allreduce([t]).wait())

    # ------------------------------------------------------------------ broadcast
    def _bcast(self, label: str, count: int, op: Callable[[Buffer], None], raw: bool) -> Case:
        buf = self._buffer(count, raw)

        def fill() -> None:
            buf[...] = self.value

        return Case(label, lambda: op(buf), fill, lambda: bool((buf == 1.0).all()))

    def broadcast(self, count: int) -> Case:
        """``Topology.broadcast_`` from rank 0."""
        return self._bcast("hadpsgd broadcast_", count, lambda t: self.topo.broadcast_(t, 0),
                           raw=False)

    def mpi_bcast(self, count: int, direct: bool = False) -> Case:
        """Raw ``Bcast`` from rank 0."""
        world = self.topo.comm
        call = self._raw(lambda a: world.Bcast(a, root=0), count, direct)
        return self._bcast("mpi4py Bcast" + self._variant(direct), count, call, raw=True)

    # ------------------------------------------------------------------ pair exchange
    def _pair(self, label: str, count: int, op: Callable[[Buffer, Buffer, int], None],
              raw: bool) -> Case:
        send, recv = self._buffer(count, raw), self._buffer(count, raw)
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
                          lambda s, r, p: self.topo.exchange(s, r, p, tag=0), raw=False)

    def mpi_sendrecv(self, count: int, direct: bool = False) -> Case:
        """Raw ``Sendrecv`` with the even/odd partner."""
        world = self.topo.comm
        peer = self.peer

        def sendrecv(s: Buffer, r: Buffer) -> None:
            world.Sendrecv(s, dest=peer, sendtag=0, recvbuf=r, source=peer, recvtag=0)

        # Only the send buffer goes to the host and only the receive buffer comes back.
        call = self._raw(sendrecv, count, direct, nbufs=2, inputs=(0,), outputs=(1,))
        return self._pair("mpi4py Sendrecv" + self._variant(direct), count,
                          lambda s, r, p: call(s, r), raw=True)


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

    The file's path is chosen by rank 0 and broadcast over MPI (no TCP store, no env; see
    :func:`benchmarks._launch.file_store`).
    """
    import torch.distributed as dist

    store, path = file_store(topo.comm, store_dir, "bench-gloo")
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


def _route(view: Topology) -> dict[str, str]:
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
                return timer.time(case, size)  # the case (its buffers) is dropped afterwards

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
                                            _route(view) if view is not None else None))
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
    topo = hcomm.init(ranks_per_node=a.ranks_per_node, device=a.device,
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


def device_record(topo: Topology) -> dict[str, Any]:
    """Where the measured tensors live and which path they take (the JSON record's ``device``).

    Args:
        topo: The run's topology.

    Returns:
        The device, whether MPI is CUDA-aware, the intra-node backend of device and host
        tensors, ``Topology.route`` of the float32 buffers, the rank placement and the
        topology's notes (why a faster path is off).
    """
    gpu = topo.device.type == "cuda"
    return {"type": topo.device.type, "name": str(topo.device),
            "gpu": torch.cuda.get_device_name(topo.device) if gpu else None,
            "cuda": torch.version.cuda if gpu else None,
            "cuda_aware": topo.cuda_aware, "intra_backend": topo.intra_backend,
            "host_intra_backend": topo.reducer.intra.name, "route": _route(topo),
            "placement": topo.placement, "notes": list(topo.notes)}


def _run(a: argparse.Namespace, topo: Topology, mpi: Any) -> int:
    root = topo.rank == 0
    gpu = topo.device.type == "cuda"

    def say(text: str) -> None:
        if root:
            print(text, flush=True)

    hosts = _count_hosts(topo, mpi)
    json_path = Path(topo.comm.bcast(str(a.json or default_json_path()) if root else None))
    a.op, notes = _usable_ops(a, topo)
    gloo, store = None, None
    if "allreduce" in a.op and not a.no_gloo:
        if gpu:
            notes.append("gloo allreduce baseline skipped on cuda: it is a view of host "
                         "tensors (see mpi4py+cp for the host path)")
        else:
            store_dir = a.gloo_dir or (str(json_path.parent) if hosts > 1
                                       else tempfile.gettempdir())
            gloo, store = gloo_world(topo, store_dir)
    views: dict[str, Topology] = {}
    if "intra" in a.op:
        names, skipped = intra_view_names(a.device, topo.intra_backend, a.intra_backends)
        notes += skipped
        views = backend_views(topo, names)
    device = device_record(topo)

    say(f"# hadpsgd.comm microbenchmark: {topo.describe()}")
    say(f"# {hosts} host(s), {os.cpu_count()} CPUs on rank 0's host, MPI: "
        f"{_mpi_name(mpi)}, torch {torch.__version__}")
    say(f"# ops {' '.join(a.op)}, {format_size(a.sizes[0])} .. {format_size(a.sizes[-1])} "
        f"float32, iters <= {a.iters} (>= {a.min_iters}, ~{a.max_time:g} s per measurement), "
        f"warmup <= {a.warmup}; time = max over ranks of the mean per op")
    say("# ratio = hadpsgd busbw / baseline busbw (= baseline time / hadpsgd time; > 1: "
        "hadpsgd faster)")
    if gpu:
        say(f"# device {device['name']} ({device['gpu']}), MPI CUDA-aware: "
            f"{'yes' if topo.cuda_aware else 'no'}, float32 route: intra-node "
            f"{device['route']['intra']}, inter-node {device['route']['inter']}")
        say("# mpi4py+cp = raw mpi4py with the user's copies (device -> pinned host, MPI on "
            "NumPy, host -> device, synchronize); mpi4py-dev = raw mpi4py on the device "
            "tensor" + ("" if topo.cuda_aware else " (not measured: MPI is not CUDA-aware)"))
        for note in topo.notes:
            say(f"# note: {note}")
    for note in notes:
        say(f"# {note}")
    say(table_header(a.device))
    started = time.time()
    rows = []
    for row in sweep(a, topo, mpi, gloo, views):
        rows.append(row)
        say(format_row(row, a.device))
    elapsed = time.time() - started

    for view in views.values():
        if view is not topo:
            view.close()
    topo.comm.Barrier()
    if root:
        remove_store(store)
        summary = summarize(rows, topo.describe(), a.device)
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
            "device": device,
            "options": {"ops": a.op, "sizes": a.sizes, "iters": a.iters, "warmup": a.warmup,
                        "min_iters": a.min_iters, "max_time": a.max_time,
                        "gloo": gloo is not None, "intra_backends": list(views),
                        "device": a.device, "notes": notes},
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
