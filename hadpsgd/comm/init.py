"""``hadpsgd.comm.init``: start MPI, find (or emulate) the nodes, pick the backends."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from hadpsgd import env
from hadpsgd.comm.backends import GlooIntra, IntraBackend, MPIIntra
from hadpsgd.comm.deadline import Watchdog, timeout_from_env
from hadpsgd.comm.hierarchical import HierAlgo, Reducer
from hadpsgd.comm.mpi import check_thread_level, cuda_support, mpi
from hadpsgd.comm.objects import allgather_object
from hadpsgd.comm.placement import (
    device_label,
    resolve_device,
    singleton_launch,
    summarize,
)
from hadpsgd.comm.topology import Topology, TopologyError
from hadpsgd.env import EnvError

log = logging.getLogger("hadpsgd.comm")

INTRA_BACKENDS = env.INTRA_BACKEND_CHOICES
DEFAULT_CPU_INTRA = "mpi"
"""Intra-node backend of host tensors when not chosen (``auto``; on GPUs NCCL takes the
device tensors, see ``_device_backend``). Measured with ``python -m benchmarks.comm --op
intra`` (docs/benchmarks.md): MPI's shared-memory path is 4-30x faster than gloo up to ~1 MiB
and inside the hierarchical allreduce; gloo won some node-local allreduces of tens of MiB
with 2 ranks.
Gradient buckets of the presets are small-to-medium, so MPI is the default."""
DEFAULT_BUCKET_MB = env.DEFAULT_BUCKET_MB
"""Bucket size when neither ``bucket_mb`` nor ``HADPSGD_BUCKET_MB`` is given."""


def _resolve_ranks_per_node(ranks_per_node: int | None) -> int | None:
    """The emulated node size (argument, else ``HADPSGD_RANKS_PER_NODE``), checked.

    Raises:
        EnvError: For a bad ``HADPSGD_RANKS_PER_NODE``.
        TopologyError: For an argument < 1.
    """
    if ranks_per_node is None:
        ranks_per_node = env.ranks_per_node()
    if ranks_per_node is not None and ranks_per_node < 1:
        raise TopologyError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return ranks_per_node


def _backend_name(name: str) -> str:
    """The requested intra-node backend (argument, else ``HADPSGD_INTRA_BACKEND``), checked.

    Raises:
        EnvError: For a bad ``HADPSGD_INTRA_BACKEND``.
        TopologyError: For an unknown argument.
    """
    if name == "auto":
        name = env.intra_backend()
    if name not in INTRA_BACKENDS:
        raise TopologyError(f"intra-node backend {name!r} is unknown; choose one of "
                            f"{', '.join(INTRA_BACKENDS)}")
    return name


def _host_backend(name: str, intra: object, watchdog: Watchdog,
                  node_ranks: list[int]) -> IntraBackend:
    """The backend of host tensors: ``gloo`` if asked for, else MPI's shared-memory path."""
    if name == "gloo":
        return GlooIntra(intra, watchdog, node_ranks)
    return MPIIntra(intra, watchdog, node_ranks)


def _device_backend(name: str, intra: Any, watchdog: Watchdog, node_ranks: list[int],
                    device: torch.device, notes: list[str]) -> IntraBackend | None:
    """NCCL for device tensors when it can run, else None (staged host path), with a note.

    NCCL needs one GPU per rank of the node: ranks that share a GPU (more ranks than GPUs,
    as in the tests on one GPU) take the host-staged path instead. The decision is the
    node's, agreed over ``intra``, so every member builds the same backends.
    """
    if device.type != "cuda" or intra.Get_size() == 1:
        return None
    if name in ("mpi", "gloo"):
        notes.append(f"intra-node device tensors are staged through host memory for "
                     f"--intra-backend {name}; --intra-backend auto (NCCL on GPUs) keeps "
                     "them on the device")
        return None
    from hadpsgd.comm.nccl import NCCLIntra, nccl_available

    ok, why = nccl_available()
    labels = allgather_object(intra, watchdog, device_label(device), node_ranks)
    if ok and len(set(labels)) < len(labels):
        ok, why = False, (f"ranks of a node share a GPU ({', '.join(labels)}); NCCL needs "
                          "one GPU per rank: launch at most one rank per GPU")
    # Agree: NCCL only if every member can run it (an empty string means yes).
    verdicts = allgather_object(intra, watchdog, "" if ok else why, node_ranks)
    reasons = sorted({v for v in verdicts if v})
    if reasons:
        if name == "nccl":
            raise TopologyError(f"--intra-backend nccl cannot run: {'; '.join(reasons)}. "
                                "Use --intra-backend auto (host-staged MPI) or mpi")
        notes.append(f"intra-node NCCL is off ({'; '.join(reasons)}): device tensors are "
                     "staged through host memory and reduced by MPI, which is slower")
        return None
    return NCCLIntra(intra, watchdog, node_ranks, device)


def init(ranks_per_node: int | None = None, device: str = "auto", intra_backend: str = "auto",
         hier_algo: HierAlgo = "auto", bucket_mb: float | None = None) -> Topology:
    """Initialise MPI, discover (or emulate) nodes and build the communicators and backends.

    Args:
        ranks_per_node: Emulate nodes of this many consecutive ranks (also env
            ``HADPSGD_RANKS_PER_NODE``); ``None`` uses the real nodes from
            ``Split_type(COMM_TYPE_SHARED)``.
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        intra_backend: ``auto``, ``mpi``, ``gloo`` or ``nccl`` (env ``HADPSGD_INTRA_BACKEND``).
        hier_algo: ``auto``, ``shard`` or ``leader`` (see :mod:`hadpsgd.comm.hierarchical`).
        bucket_mb: Bucket size in MiB for large buffers (env ``HADPSGD_BUCKET_MB``, default 64).

    Returns:
        The :class:`Topology` of this learner.

    Raises:
        TopologyError: For an impossible layout, device or backend request, or a launch
            that MPI sees as one-rank jobs (``srun`` without ``--mpi=pmix``, another MPI's
            ``mpirun``: see :func:`hadpsgd.comm.placement.singleton_launch`).
    """
    MPI = mpi()  # noqa: N806 - conventional name of the module
    thread_level = check_thread_level(MPI)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    singleton = singleton_launch(size)
    if singleton:
        raise TopologyError(singleton)
    try:
        # Every HADPSGD_* variable at once, before any work: a bad one is the user's mistake,
        # reported (as TopologyError, exit 2) like a bad flag, whichever variable it is.
        env.check()
        backend_name = _backend_name(intra_backend)
        timeout = timeout_from_env()
        rpn = _resolve_ranks_per_node(ranks_per_node)
        bucket = bucket_mb if bucket_mb is not None else env.bucket_mb()
    except EnvError as err:
        raise TopologyError(str(err)) from None
    if bucket <= 0:
        raise TopologyError(f"bucket_mb must be > 0, got {bucket}")
    watchdog = Watchdog(world.Dup(), timeout,
                        thread_multiple=thread_level >= MPI.THREAD_MULTIPLE, answer=True)
    host = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    host_size = host.Get_size()

    if rpn is not None:
        if rpn > size:
            raise TopologyError(
                f"ranks_per_node={rpn} is larger than the {size} launched ranks; launch at least "
                f"{rpn} ranks or lower --ranks-per-node"
            )
        node = rank // rpn
        intra = world.Split(color=node, key=rank)
        num_nodes = -(-size // rpn)
        node_sizes = [min(rpn, size - n * rpn) for n in range(num_nodes)]
    else:
        intra = host
        # Number the nodes by their leaders' world ranks, so node indices are stable.
        is_leader = intra.Get_rank() == 0
        leaders = world.Split(color=0 if is_leader else MPI.UNDEFINED, key=rank)
        mine = np.array([leaders.Get_rank() if is_leader else -1], dtype=np.int64)
        if is_leader:
            leaders.Free()
        watchdog.wait(intra.Ibcast(mine, root=0), "node discovery (broadcast)")
        node = int(mine[0])
        pairs = np.empty(2 * size, dtype=np.int64)
        watchdog.wait(world.Iallgather(np.array([node, intra.Get_size()], dtype=np.int64),
                                       pairs), "node discovery (allgather)")
        num_nodes = int(pairs[0::2].max()) + 1
        node_sizes = [0] * num_nodes
        for n, s in zip(pairs[0::2], pairs[1::2], strict=True):
            node_sizes[int(n)] = int(s)
    local_rank, local_size = intra.Get_rank(), intra.Get_size()
    inter = world.Split(color=local_rank, key=node)
    node_ranks = np.empty(local_size, dtype=np.int64)
    watchdog.wait(intra.Iallgather(np.array([rank], dtype=np.int64), node_ranks),
                  "node discovery (node ranks)")
    inter_ranks = np.empty(inter.Get_size(), dtype=np.int64)
    watchdog.wait(inter.Iallgather(np.array([rank], dtype=np.int64), inter_ranks),
                  "node discovery (inter ranks)")

    # The GPU follows the physical host, never the emulated node layout.
    host_rank = host.Get_rank()
    try:
        dev = resolve_device(device, host_rank, host_size)
    except ValueError as err:
        raise TopologyError(str(err)) from None
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        if backend_name == "nccl":
            raise TopologyError("the nccl intra-node backend needs --device cuda; on CPU use "
                                "mpi or gloo")
        if "OMP_NUM_THREADS" not in os.environ:
            # Ranks sharing a machine would otherwise each start one thread per core.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // host_size))
    notes: list[str] = []
    backend = _host_backend(backend_name, intra, watchdog, node_ranks.tolist())
    device_backend = _device_backend(backend_name, intra, watchdog, node_ranks.tolist(), dev,
                                     notes)
    cuda_aware, aware_why = cuda_support() if dev.type == "cuda" else (False, "")
    if dev.type == "cuda" and not cuda_aware and num_nodes > 1:
        notes.append(f"MPI is not CUDA-aware ({aware_why}): inter-node traffic is staged "
                     "through pinned host memory; a CUDA-aware MPI (UCX) skips the copies")
    labels = allgather_object(world, watchdog, device_label(dev))
    placement = summarize(labels)
    try:
        reducer = Reducer(world, inter, backend, watchdog, inter_ranks.tolist(), node_sizes,
                          int(bucket * 2**20), hier_algo, cuda_aware, device_backend)
    except ValueError as err:
        raise TopologyError(str(err)) from None
    topo = Topology(
        comm=world, intra=intra, inter=inter, rank=rank, size=size, local_rank=local_rank,
        local_size=local_size, node=node, num_nodes=num_nodes, node_sizes=node_sizes,
        emulated=rpn is not None, device=dev, timeout=watchdog.timeout,
        thread_level=thread_level,
        intra_backend=(device_backend or backend).name, cuda_aware=cuda_aware,
        node_ranks=node_ranks.tolist(), inter_ranks=inter_ranks.tolist(), watchdog=watchdog,
        reducer=reducer, _backend=backend, _mpi=MPI, host_rank=host_rank, host_size=host_size,
        placement=placement, hosts=[label.partition(":")[0] for label in labels], notes=notes,
    )
    log.info("hadpsgd.comm: %s", topo.describe())
    return topo
