"""Where a process sits on its machine: its GPU, and whether the launch really formed one job.

The GPU comes from the rank's place on its *physical* host (the shared-memory split of the
world), never from the emulated node layout: ``--ranks-per-node 1`` on an 8-GPU host still
puts its 8 learners on 8 GPUs.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import torch

# Launchers that announce how many tasks they started: (variable, launcher, fix).
_LAUNCHER_SIZES = (
    ("SLURM_STEP_NUM_TASKS", "srun",
     "srun needs MPI support: srun --mpi=pmix (or pmi2; see `srun --mpi=list`), or start the "
     "job step with mpirun inside the allocation"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun",
     "mpi4py loaded another MPI than the one whose mpirun started it: launch with the mpirun "
     "of the MPI mpi4py uses (python -c 'from mpi4py import MPI; "
     "print(MPI.Get_library_version())'), or set MPI4PY_LIBMPI"),
    ("PMI_SIZE", "a PMI launcher (MPICH Hydra, Intel MPI)",
     "mpi4py loaded another MPI than the one whose mpiexec started it: launch with the "
     "mpiexec of the MPI mpi4py uses, or set MPI4PY_LIBMPI"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's launcher",
     "launch with the mpirun of the MPI mpi4py uses"),
    ("WORLD_SIZE", "torchrun",
     "hadpsgd learners are MPI processes: launch with mpirun -np N python -m hadpsgd.run "
     "(or python -m hadpsgd.launch -n N)"),
)


def singleton_launch(mpi_size: int, env: Mapping[str, str] | None = None) -> str | None:
    """Why this launch is N independent one-rank jobs, or None if it is not.

    A launcher that reports several tasks while MPI reports one means every process would
    train alone on the whole data set (``srun`` without ``--mpi=pmix``, or an ``mpirun`` of
    another MPI than the one mpi4py loaded).

    Args:
        mpi_size: The size of ``MPI.COMM_WORLD``.
        env: The environment (default ``os.environ``).

    Returns:
        The message naming the launcher and the fix, or None.
    """
    if mpi_size != 1:
        return None
    env = os.environ if env is None else env
    for var, launcher, fix in _LAUNCHER_SIZES:
        raw = env.get(var, "").strip()
        if raw.isdigit() and int(raw) > 1:
            return (f"{launcher} started {raw} tasks ({var}={raw}), but MPI sees a world of "
                    f"1: each process would train alone. Fix: {fix}.")
    return None


_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                    "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK")
"""Where launchers put a process's rank on its host (Open MPI, MPICH Hydra, Slurm,
MVAPICH, PMI), in the order they are trusted."""


def launcher_local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank on its host as its launcher announced it, before MPI starts.

    Returns:
        The first of :data:`_LOCAL_RANK_VARS` that holds a non-negative integer, or None.
    """
    env = os.environ if env is None else env
    for var in _LOCAL_RANK_VARS:
        raw = env.get(var, "").strip()
        if raw.isdigit():
            return int(raw)
    return None


def gpu_index(host_rank: int, host_size: int, device_count: int) -> int:
    """The GPU a learner uses: its rank among the processes of its physical host.

    With one visible device per process (``srun --gpus-per-task=1``, or a per-rank
    ``CUDA_VISIBLE_DEVICES``) that device is index 0. With more processes than GPUs on a
    host, processes share GPUs round-robin (then NCCL cannot be used inside the node).

    Args:
        host_rank: Rank among the processes on this physical host (0-based).
        host_size: Processes on this host.
        device_count: GPUs this process can see.
    """
    if device_count < 1:
        raise ValueError("no GPU is visible to this process")
    if host_size < 1 or not 0 <= host_rank < host_size:
        raise ValueError(f"host rank {host_rank} out of range for {host_size} processes")
    return host_rank % device_count


def resolve_device(device: str, host_rank: int, host_size: int) -> torch.device:
    """The torch device of a learner (``auto``: CUDA when available, bound by host rank).

    Raises:
        ValueError: For an unknown device name, or CUDA asked for where there is none.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} was asked for but CUDA is not available; use --device cpu"
            )
        return torch.device("cuda", gpu_index(host_rank, host_size, torch.cuda.device_count()))
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def device_label(device: torch.device) -> str:
    """``host:device`` with the GPU's UUID, so two processes can tell if they share a GPU.

    The index alone is not enough: under per-process ``CUDA_VISIBLE_DEVICES`` every rank
    sees its own GPU as ``cuda:0``.
    """
    host = socket.gethostname()
    if device.type != "cuda":
        return f"{host}:cpu"
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index))
    return f"{host}:cuda:{device.index}:{uuid}"


def summarize(labels: list[str]) -> str:
    """One short line from every rank's :func:`device_label`: ``host[ranks -> devices]``."""
    by_host: dict[str, list[str]] = {}
    for rank, label in enumerate(labels):
        host, _, rest = label.partition(":")
        dev = ":".join(rest.split(":")[:2])  # cpu | cuda:N
        by_host.setdefault(host, []).append(f"{rank}>{dev}")
    return "; ".join(f"{host} [{' '.join(items)}]" for host, items in by_host.items())
