"""What the benchmarks share: run a worker on N local MPI ranks, emit the record, rendezvous.

The rendezvous (:func:`file_store`) is how the ranks of a benchmark build the
torch.distributed groups of their gloo, NCCL and DDP baselines without environment variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hadpsgd.launch import launch_env, mpirun_command  # noqa: E402


def run_worker(worker: str, args: list[str], nprocs: int | None, timeout: float,
               env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``python worker args`` on ``nprocs`` ranks; return the JSON lines it printed.

    ``nprocs=None`` runs one plain process (no mpirun): the single-process baselines.

    Raises:
        SystemExit: If the job fails, with its command and output.
    """
    cmd = [sys.executable, worker, *args]
    if nprocs is not None:
        cmd = mpirun_command(nprocs, [], module="x")[:-3] + cmd  # the launcher and its flags
    full_env = launch_env(nprocs=nprocs or 1)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
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
    import torch.distributed as dist

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
