"""The ranks' side of ``python -m benchmarks.comm``: set up, run the sweep, report.

Every rank builds the topology (and the gloo group and intra-node backend views the options
ask for) and runs the same sweep (:mod:`benchmarks.comm.measure`). Rank 0 prints the table as
it goes, writes the JSON file and the summary line.

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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common.launch import file_store, remove_store
from benchmarks.comm.measure import route_record, sweep
from benchmarks.comm.report import (
    default_json_path,
    format_row,
    format_size,
    intra_view_names,
    summarize,
    table_header,
)
from hadpsgd import comm as hcomm
from hadpsgd.comm import Topology
from hadpsgd.comm.mpi import mpi as hmpi


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
    :func:`benchmarks._common.launch.file_store`).
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
                      bucket_mb=a.bucket_mb, preload=False)  # no optimizer steps here
    mpi = hmpi()  # the module comm.init started
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
            "host_intra_backend": topo.reducer.intra.name, "route": route_record(topo),
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
