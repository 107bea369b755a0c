"""``python -m hadpsgd.comm``: what this machine gives hadpsgd, before a long job finds out.

Run it as the job would run (``srun --mpi=pmix python -m hadpsgd.comm`` or ``mpirun -np N
python -m hadpsgd.comm``): rank 0 prints the MPI library mpi4py loaded and its thread level,
whether it is CUDA-aware (and how that was decided), torch and its NCCL, every ``HADPSGD_*``
variable set, and per host the ranks and the GPUs they see. A bad ``HADPSGD_*`` value, an
MPI below ``THREAD_MULTIPLE`` or a singleton launch is flagged; the exit code is 1 then.
``python -m hadpsgd.env``, its older name, runs it too.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from hadpsgd import env
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.mpi import cuda_support, library_version, loaded_libmpi, mpi, thread_level_name
from hadpsgd.comm.objects import allgather_object
from hadpsgd.comm.placement import singleton_launch


def _gpus() -> tuple[int, str]:
    try:
        import torch
    except ImportError:
        return 0, "torch not importable"
    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__}, no CUDA device"
    # Asked of the build, not of a tensor: a tensor would make a CUDA context on GPU 0 from
    # every rank of the host (hundreds of MiB each, and a busy GPU 0) just to print a line.
    import torch.distributed as dist

    nccl = (".".join(map(str, torch.cuda.nccl.version()))
            if dist.is_available() and dist.is_nccl_available() else "unavailable")
    return torch.cuda.device_count(), f"torch {torch.__version__}, NCCL {nccl} (torch's)"


def report() -> tuple[list[str], bool]:
    """The report's lines on rank 0 (empty elsewhere) and whether everything is usable."""
    MPI = mpi()  # noqa: N806 - the module is conventionally MPI
    comm = MPI.COMM_WORLD
    problems: list[str] = []
    try:
        env.check()
    except env.EnvError as err:
        problems.append(str(err))
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        problems.append(f"MPI thread level {thread_level_name(level)}: adpsgd needs MULTIPLE")
    single = singleton_launch(comm.Get_size(), dict(os.environ))
    if single:
        problems.append(single)
    gpus, torch_line = _gpus()
    mine: dict[str, Any] = {"host": socket.gethostname(), "gpus": gpus,
                            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "problem": bool(problems)}
    try:
        timeout = env.timeout()
    except env.EnvError:
        timeout = env.DEFAULT_TIMEOUT_S  # the bad value is one of the problems reported
    # One exchange, with the comm layer's deadline: a rank that never arrives is named.
    every = allgather_object(comm, Watchdog(comm.Dup(), timeout), mine)
    bad = sum(r["problem"] for r in every)
    if comm.Get_rank() != 0:
        return [], bad == 0
    aware, why = cuda_support()
    lines = [f"MPI library: {library_version()} ({loaded_libmpi() or 'path unknown'})",
             f"MPI world: {comm.Get_size()} rank(s), thread level {thread_level_name(level)}",
             f"CUDA-aware MPI: {'yes' if aware else 'no'} ({why})",
             f"torch: {torch_line}"]
    hosts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rank_info in every:
        hosts[rank_info["host"]].append(rank_info)
    for host, ranks in hosts.items():
        seen = sorted({r["gpus"] for r in ranks})
        vis = sorted({str(r["visible"]) for r in ranks if r["visible"] is not None})
        lines.append(f"host {host}: {len(ranks)} rank(s), GPUs visible per rank {seen}"
                     + (f", CUDA_VISIBLE_DEVICES {vis}" if vis else ""))
    set_vars = sorted(k for k in os.environ if k.startswith("HADPSGD_"))
    lines.append("HADPSGD_* set: " + (", ".join(f"{k}={os.environ[k]}" for k in set_vars)
                                      if set_vars else "none"))
    lines += [f"problem: {p}" for p in problems]
    others = bad - (1 if problems else 0)
    if others:
        lines.append(f"problem: {others} other rank(s) found a problem (run them alone to see)")
    return lines, bad == 0


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; 0 if every rank is usable, 1 otherwise (2 for a bad flag)."""
    argparse.ArgumentParser(
        prog="python -m hadpsgd.comm",
        description="Check this machine for hadpsgd under mpirun: the MPI library and its "
                    "thread level, CUDA-awareness, torch's NCCL, the ranks and GPUs per "
                    "host.").parse_args(argv)
    lines, ok = report()
    for line in lines:
        print(f"[hadpsgd.comm] {line}", flush=True)
    return 0 if ok else 1

