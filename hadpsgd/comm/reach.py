"""``python -m hadpsgd.comm.reach HOST...``: does every host's rank hear every other's over MPI?

The launcher's check before a job across hosts (:mod:`hadpsgd.launch.preflight`), one rank a
host, rank ``i`` on the ``i``-th host named. Each rank posts a small message to every other
and a receive from every other, on MPI's own data path (the same transport, interface and
ports the training will take), and waits a bounded time. It then prints one line,
``HADPSGD_REACH {json}``: its host name, the hosts it heard from and those it did not, and
the versions that must agree across hosts (Python, torch, hadpsgd, the MPI library). A
connection a firewall drops never completes, so the wait is by polling, under a deadline;
a rank that missed a peer ends without ``MPI_Finalize`` (which would wait for the
unfinished send) and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from hadpsgd.comm.mpi import library_version, mpi

PREFIX = "HADPSGD_REACH "
"""Start of each rank's report line (the launcher parses what follows as JSON)."""


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """What must agree on every host (torch's and hadpsgd's pickles, MPI's wire)."""
    import hadpsgd

    return {"python": platform.python_version(), "torch": _version("torch"),
            "hadpsgd": hadpsgd.__version__, "mpi4py": _version("mpi4py"),
            "mpi": library_version().splitlines()[0].strip() if library_version() else "?"}


def probe(hosts: Sequence[str], deadline_s: float) -> dict[str, Any]:
    """Exchange a message with every other rank within ``deadline_s``; this rank's report.

    Args:
        hosts: The host of each rank, as the launcher named them (for the report).
        deadline_s: Seconds to wait for every peer's message.
    """
    MPI = mpi()  # noqa: N806 - the module is conventionally MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != len(hosts):
        raise SystemExit(f"hadpsgd.comm.reach: {size} ranks for {len(hosts)} hosts; run one "
                         "rank a host")
    peers = [j for j in range(size) if j != rank]
    # A byte each way: what is tested is that MPI's data path between the hosts carries it.
    recvs = {j: comm.Irecv(bytearray(1), source=j, tag=7) for j in peers}
    sends = [comm.Isend(b"\1", dest=j, tag=7) for j in peers]  # held while in flight
    start = time.monotonic()
    heard: dict[int, float] = {}
    pause = 1e-3
    while len(heard) < len(peers) and time.monotonic() - start < deadline_s:
        for j, req in recvs.items():
            if j not in heard and req.Test():
                heard[j] = time.monotonic() - start
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    del sends  # complete or never to be (a dropped link): the rank exits either way
    return {
        "rank": rank, "named": hosts[rank], "host": socket.gethostname(),
        "heard": {hosts[j]: round(t, 3) for j, t in sorted(heard.items())},
        "missed": [hosts[j] for j in peers if j not in heard],
        "versions": versions(), "seconds": round(time.monotonic() - start, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the probe and print this rank's line; exit 1 where a peer was not heard."""
    parser = argparse.ArgumentParser(prog="python -m hadpsgd.comm.reach")
    parser.add_argument("hosts", nargs="+", help="the host of each rank, in rank order")
    parser.add_argument("--deadline", type=float, default=20.0,
                        help="seconds to wait for every other host's message (default 20)")
    opts = parser.parse_args(argv)
    report = probe(opts.hosts, opts.deadline)
    print(PREFIX + json.dumps(report), flush=True)
    if report["missed"]:
        sys.stderr.flush()
        os._exit(1)  # MPI_Finalize would wait for the send a dropped link never takes
    mpi().COMM_WORLD.Barrier()  # everyone heard everyone: leave together
    return 0


if __name__ == "__main__":
    sys.exit(main())
