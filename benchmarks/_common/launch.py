"""What every benchmark driver shares: launch ranks, emit the record, rendezvous, CUDA check.

The drivers start their ranks through :func:`bench_env` (the launcher's environment plus the
repository on ``PYTHONPATH``, so ``python -m benchmarks...`` resolves in every rank whatever the
working directory) and, for one measurement per job, :func:`run_worker`. The ranks of a
benchmark build the torch.distributed groups of their gloo, NCCL and DDP baselines through
:func:`file_store`, without environment variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hadpsgd.launch import launch_env, mpirun_command
from hadpsgd.launch.mpirun import LAUNCH_TRIES, launcher_failed_to_start

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: the directory holding ``benchmarks/`` and ``hadpsgd/``."""


def bench_env(nprocs: int | None = None,
              extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark job on ``nprocs`` local ranks.

    ``hadpsgd.launch.launch_env`` (root allowed, one share of the cores per rank) with
    :data:`ROOT` first on ``PYTHONPATH``: the ranks import ``benchmarks`` and ``hadpsgd`` from
    this checkout even when started from another directory.

    Args:
        nprocs: Ranks that share this machine's cores (``None``: one plain process).
        extra: Variables to set on top (they win over the launcher's defaults).

    Returns:
        A new environment; this process's is not modified.
    """
    env = launch_env(nprocs=nprocs or 1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def worker_command(module: str, args: Sequence[str], nprocs: int | None) -> list[str]:
    """``python -m module args``, under the venv's mpirun on ``nprocs`` ranks unless ``None``.

    Raises:
        hadpsgd.launch.LauncherError: If ``nprocs`` is given and no MPI launcher is found.
    """
    if nprocs is None:
        return [sys.executable, "-m", module, *args]
    return mpirun_command(nprocs, list(args), module=module)


def run_job(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, retried on a start.

    A job is started again where Open MPI's launcher failed before any rank existed (nothing
    of it ran).
    """
    for _ in range(LAUNCH_TRIES):
        out = subprocess.run(list(cmd), capture_output=True, text=True, **kwargs)
        if out.returncode == 0 or not launcher_failed_to_start(out.stdout + out.stderr):
            break
    return out


def run_worker(module: str, args: Sequence[str], nprocs: int | None, timeout: float,
               env: Mapping[str, str] | None = None,
               two_hosts: str | None = None) -> list[dict[str, Any]]:
    """Run the worker ``module`` on ``nprocs`` ranks; return the JSON lines it printed.

    ``nprocs=None`` runs one plain process (no mpirun): the single-process baselines.

    Args:
        module: The worker, e.g. ``benchmarks.training.bmuf_worker``.
        args: Its command line.
        nprocs: Ranks, or ``None`` for one process without MPI.
        timeout: Seconds the job may take.
        env: Variables to set for the job (see :func:`bench_env`).
        two_hosts: Run the ranks on two emulated hosts joined by a link of this rate
            (``300mbit``; :class:`benchmarks._common.netns.TwoHosts`), half on each.

    Raises:
        SystemExit: If the job fails, with its command and output.
    """
    job_env = bench_env(nprocs, env)
    if two_hosts is None or nprocs is None:
        cmd = worker_command(module, args, nprocs)
        out = run_job(cmd, timeout=timeout, env=job_env)
    else:
        from benchmarks._common.netns import TwoHosts

        # The ranks on host B get their environment only through mpirun -x.
        forward = {k: v for k, v in job_env.items()
                   if k.startswith("HADPSGD_") or k in ("PYTHONPATH", "OMP_NUM_THREADS")}
        with TwoHosts(rate=two_hosts, env=forward) as hosts:
            cmd = hosts.mpirun(nprocs, [sys.executable, "-m", module, *args])
            out = run_job(cmd, timeout=timeout, env=job_env)
    if out.returncode != 0:
        raise SystemExit(f"benchmark step failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    return [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]


def emit(record: dict[str, Any], path: Path | None) -> None:
    """Print the record as one JSON line, and write it to ``path`` when given."""
    print(json.dumps(record))
    if path:
        path.write_text(json.dumps(record, indent=2) + "\n")


def file_store(comm: Any, store_dir: str, tag: str) -> tuple[Any, str]:
    """A torch.distributed ``FileStore`` shared by every rank of the MPI communicator ``comm``.

    Rank 0 picks a fresh file name in ``store_dir`` and broadcasts it over MPI, so the
    rendezvous needs neither a TCP port nor ``MASTER_ADDR``-style environment variables.
    Collective over ``comm``.

    Args:
        comm: An mpi4py communicator; its ranks and size are the store's.
        store_dir: A directory every rank can see (a shared file system across hosts).
        tag: Part of the file name, to tell the benchmarks' files apart.

    Returns:
        The store and its file's path (rank 0 removes it with :func:`remove_store`).
    """
    import torch.distributed as dist  # only in the ranks: the drivers never need torch

    path = None
    if comm.Get_rank() == 0:
        os.makedirs(store_dir, exist_ok=True)
        path = os.path.join(store_dir, f"hadpsgd-{tag}-{uuid.uuid4().hex}")
    path = comm.bcast(path, root=0)
    return dist.FileStore(path, comm.Get_size()), path


def remove_store(path: str | None) -> None:
    """Delete a :func:`file_store` file once every rank is done with it (call on one rank)."""
    if path and os.path.exists(path):
        try:
            os.unlink(path)
        except OSError:
            pass


def cuda_missing(prog: str, device: str) -> bool:
    """Whether ``--device cuda`` was asked for without CUDA (then the reason is printed).

    The drivers call it before launching any rank, so the user gets one line, not N
    tracebacks.
    """
    if device != "cuda":
        return False
    import torch  # only here: the CPU drivers never need it

    if torch.cuda.is_available():
        return False
    print(f"{prog}: --device cuda, but CUDA is not available to torch {torch.__version__}; "
          "use --device cpu", file=sys.stderr)
    return True


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
