"""``hadpsgd.comm.init``: start MPI, find (or emulate) the nodes, pick the backends."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from hadpsgd import env
from hadpsgd.comm import share_gpu
from hadpsgd.comm.backends import GlooIntra, IntraBackend, MPIIntra
from hadpsgd.comm.deadline import Watchdog, timeout_from_env
from hadpsgd.comm.hierarchical import HierAlgo, Reducer
from hadpsgd.comm.hostlink import device_host_link
from hadpsgd.comm.mpi import check_thread_level, cuda_support, mpi
from hadpsgd.comm.objects import allgather_object, disagreements
from hadpsgd.comm.placement import (
    device_label,
    launcher_local_rank,
    resolve_device,
    singleton_launch,
    summarize,
)
from hadpsgd.comm.preload import Preload
from hadpsgd.comm.topology import Topology, TopologyError
from hadpsgd.env import EnvError
from hadpsgd.env.cpus import usable_cpus

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


def agree_routes(verdicts: list[tuple[str, bool]]) -> tuple[list[str], bool]:
    """The world's one decision from every rank's ``(why NCCL cannot run, CUDA-aware)``.

    An empty reason means NCCL can run on that rank's node (or the question does not arise
    there). NCCL runs inside the nodes only if it can on every node, and device buffers go
    to MPI only if every rank's MPI is CUDA-aware: one node staging while another does not
    would cut its messages differently (staging chunks, host dtypes) and the job would
    hang in the first mismatched collective.

    Returns:
        The distinct reasons against NCCL (empty: NCCL everywhere) and the agreed
        CUDA-awareness.
    """
    reasons = sorted({why for why, _ in verdicts if why})
    return reasons, all(aware for _, aware in verdicts)


def _device_route(name: str, world: Any, intra: Any, watchdog: Watchdog, node_ranks: list[int],
                  device: torch.device, cuda_aware: bool, notes: list[str],
                  world_labels: list[str]) -> tuple[IntraBackend | None, bool]:
    """NCCL for device tensors when it can run on every node, and the agreed CUDA-awareness.

    NCCL needs one GPU per rank of the node: ranks that share a GPU (more ranks than GPUs,
    as in the tests on one GPU) take the host-staged path instead. Each node decides from its
    members' device labels (``world_labels``, by world rank, as the start-up gathered them),
    then the world agrees (:func:`agree_routes`), so every rank builds the same routes. Every
    rank calls this (collectively), whatever its device.
    """
    why = ""
    if device.type == "cuda" and intra.Get_size() > 1 and name not in ("mpi", "gloo"):
        from hadpsgd.comm.nccl import nccl_available

        ok, why = nccl_available()
        why = "" if ok else why
        labels = [world_labels[r] for r in node_ranks]
        if not why and len(set(labels)) < len(labels):
            why = (f"ranks of a node share a GPU ({', '.join(labels)}); NCCL needs one GPU "
                   "per rank: launch at most one rank per GPU")
    reasons, aware = agree_routes(allgather_object(world, watchdog,
                                                   (why, cuda_aware or device.type != "cuda")))
    aware = aware and cuda_aware
    if device.type != "cuda" or intra.Get_size() == 1:
        return None, aware
    if name in ("mpi", "gloo"):
        notes.append(f"intra-node device tensors are staged through host memory for "
                     f"--intra-backend {name}; --intra-backend auto (NCCL on GPUs) keeps "
                     "them on the device")
        return None, aware
    if reasons:
        if name == "nccl":
            raise TopologyError(f"--intra-backend nccl cannot run: {'; '.join(reasons)}. "
                                "Use --intra-backend auto (host-staged MPI) or mpi")
        notes.append(f"intra-node NCCL is off on every node ({'; '.join(reasons)}): device "
                     "tensors are staged through host memory and reduced by MPI, which is "
                     "slower")
        return None, aware
    from hadpsgd.comm.nccl import NCCLIntra

    return NCCLIntra(intra, watchdog, node_ranks, device), aware


def _first_contact(world: Any, timeout: float, thread_multiple: bool,
                   start: tuple[float, str]) -> Watchdog:
    """This learner's watchdog, made once every rank has come (under the deadline).

    Its control communicator is duplicated without blocking (``MPI_Comm_idup``): the
    duplication completes only when every rank has called it, so a rank frozen or stuck
    since ``MPI_Init`` is found here and named by a first watchdog that diagnoses over the
    world itself (its notes are point-to-point messages on their own tags, apart from any
    collective). Every later blocking call of the start-up is guarded by the new watchdog.

    That first wait is still MPI's start-up, under ``start`` (``HADPSGD_START_TIMEOUT``,
    else ``HADPSGD_TIMEOUT``, and the variable's name): an MPI whose ``MPI_Init`` returns
    without waiting for every rank (MPICH's Hydra) meets a rank still importing here, not
    there. The new watchdog takes ``timeout``.

    Raises:
        CommTimeoutError: Naming the ranks that never came.
    """
    first = Watchdog(world, start[0], thread_multiple=thread_multiple, setting=start[1])
    first.phase = "MPI set-up"
    control, request = world.Idup()
    first.wait(request, "first contact (control communicator, Idup)")
    watchdog = Watchdog(control, timeout, thread_multiple=thread_multiple, answer=True)
    watchdog.phase, watchdog.activity = "MPI set-up", "starting up: MPI set-up"
    return watchdog


def _bind_gpu_early(device: str) -> None:
    """Choose this process's GPU from the launcher's local rank, before MPI starts.

    A CUDA-aware MPI (UCX) sets up its GPU resources in ``MPI_Init`` on the current device:
    left at 0, every rank of a host would make a context on GPU 0. The launcher's local rank
    (Open MPI, MPICH/Hydra, Slurm, MVAPICH) gives the same GPU that :func:`resolve_device`
    later derives from MPI itself, which then has the last word.
    """
    if device not in ("auto", "cuda") or not torch.cuda.is_available():
        return
    local = launcher_local_rank()
    if local is not None and torch.cuda.device_count() > 0:
        torch.cuda.set_device(local % torch.cuda.device_count())


def init(ranks_per_node: int | None = None, device: str = "auto", intra_backend: str = "auto",
         hier_algo: HierAlgo = "auto", bucket_mb: float | None = None,
         base: Any = None, node_hint: int | None = None, preload: bool = True) -> Topology:
    """Initialise MPI, discover (or emulate) nodes and build the communicators and backends.

    Args:
        ranks_per_node: Emulate nodes of this many consecutive ranks (also env
            ``HADPSGD_RANKS_PER_NODE``); ``None`` uses the real nodes from
            ``Split_type(COMM_TYPE_SHARED)``.
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        intra_backend: ``auto``, ``mpi``, ``gloo`` or ``nccl`` (env ``HADPSGD_INTRA_BACKEND``).
        hier_algo: ``auto``, ``shard`` or ``leader`` (see :mod:`hadpsgd.comm.hierarchical`).
        bucket_mb: Bucket size in MiB for large buffers (env ``HADPSGD_BUCKET_MB``, default 64).
        base: The communicator of the learners (default ``MPI.COMM_WORLD``); after a failure,
            the survivors' (:func:`hadpsgd.comm.ulfm.shrink`).
        node_hint: With emulated nodes, this learner's node before a failure: the survivors
            keep their super-learners (renumbered in order) instead of regrouping by rank.
        preload: Import ``torch._dynamo`` in a thread while ``MPI_Init`` waits (the first
            optimizer step imports it, ~2 s of CPU: :mod:`hadpsgd.comm.preload`). False for a
            process that never steps an optimizer (communication benchmarks and checks), where
            the import would only cost its CPU.

    Returns:
        The :class:`Topology` of this learner.

    Raises:
        TopologyError: For an impossible layout, device or backend request, or a launch
            that MPI sees as one-rank jobs (``srun`` without ``--mpi=pmix``, another MPI's
            ``mpirun``: see :func:`hadpsgd.comm.placement.singleton_launch`).
    """
    _bind_gpu_early(device)
    # torch._dynamo, imported while MPI_Init waits (comm/preload.py); nothing to import where
    # no optimizer will step.
    loading = Preload() if preload else Preload(())
    try:
        MPI = mpi()  # noqa: N806 - conventional name of the module
    finally:
        loading.join()  # before this thread imports anything else
    thread_level = check_thread_level(MPI)
    world = MPI.COMM_WORLD if base is None else base
    rank, size = world.Get_rank(), world.Get_size()
    singleton = singleton_launch(size) if base is None else None
    if singleton:
        raise TopologyError(singleton)
    try:
        # Every HADPSGD_* variable at once, before any work: a bad one is the user's mistake,
        # reported (as TopologyError, exit 2) like a bad flag, whichever variable it is.
        env.check()
        backend_name = _backend_name(intra_backend)
        timeout = timeout_from_env()
        start = env.start_timeout()
        rpn = _resolve_ranks_per_node(ranks_per_node)
        bucket = bucket_mb if bucket_mb is not None else env.bucket_mb()
    except EnvError as err:
        raise TopologyError(str(err)) from None
    if bucket <= 0:
        raise TopologyError(f"bucket_mb must be > 0, got {bucket}")
    watchdog = _first_contact(world, timeout, thread_level >= MPI.THREAD_MULTIPLE, start)
    # Settings each rank reads for itself decide who joins which collective below (the node
    # split, gloo's groups, the host link's agreement): agree on them first, then act.
    problem = disagreements(allgather_object(world, watchdog, {
        "the intra-node backend (--intra-backend, HADPSGD_INTRA_BACKEND)": backend_name,
        "HADPSGD_HOST_LINK": env.host_link(),
        "HADPSGD_SHARE_GPU": env.share_gpu(),
        "the ranks per node (--ranks-per-node, HADPSGD_RANKS_PER_NODE)": rpn,
    } if node_hint is None else {}, list(range(size))))
    if problem:
        raise TopologyError(problem)
    with watchdog.guard("host communicator (Split_type)"):
        host = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    host_size = host.Get_size()

    if rpn is not None:
        if rpn > size and node_hint is None:
            raise TopologyError(
                f"ranks_per_node={rpn} is larger than the {size} launched ranks; launch at least "
                f"{rpn} ranks or lower --ranks-per-node"
            )
        node = rank // rpn
        num_nodes = -(-size // rpn)
        node_sizes = [min(rpn, size - n * rpn) for n in range(num_nodes)]
        if node_hint is not None:  # the survivors of a failure keep their super-learners
            hints = np.empty(size, dtype=np.int64)
            watchdog.wait(world.Iallgather(np.array([node_hint], dtype=np.int64), hints),
                          "node discovery (survivors' nodes)")
            order = sorted(set(hints.tolist()))
            node, num_nodes = order.index(node_hint), len(order)
            node_sizes = [int((hints == h).sum()) for h in order]
        with watchdog.guard("node communicator (Split)"):
            intra = world.Split(color=node, key=rank)
    else:
        intra = host
        # Number the nodes by their leaders' world ranks, so node indices are stable.
        is_leader = intra.Get_rank() == 0
        with watchdog.guard("node leaders' communicator (Split)"):
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
    with watchdog.guard("inter-node communicator (Split)"):
        inter = world.Split(color=local_rank, key=node)
    watchdog.phase, watchdog.activity = "topology", "starting up: topology"
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
    except ValueError as err:  # this host's GPUs: said by each rank that finds it
        raise TopologyError(str(err), uniform=False) from None
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif backend_name == "nccl":
        raise TopologyError("the nccl intra-node backend needs --device cuda; on CPU use "
                            "mpi or gloo")
    share = env.share_gpu()  # agreed above
    if share:
        why = share_gpu.problem(dev.type, host_size, size, share)
        if why:
            raise TopologyError(why)
        share_gpu.set_nccl_environment(rank)  # before any NCCL communicator exists
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a machine would otherwise each start one thread per core; on a GPU
        # rank those threads only contend with the loader and MPI for the host's cores.
        # The cores this rank may use (affinity, cgroup quota), not the machine's.
        torch.set_num_threads(max(1, usable_cpus() // host_size))
    labels, pids = zip(*allgather_object(world, watchdog, (device_label(dev), os.getpid())),
                       strict=True)
    labels = list(labels)
    if share:
        labels = [share_gpu.label(lab, r, size, share) for r, lab in enumerate(labels)]
    kinds = sorted({label.split(":")[1] for label in labels})
    if len(kinds) > 1:
        gpu_less = sorted({label.partition(":")[0] for label in labels if ":cpu" in label})
        raise TopologyError(f"the learners do not agree on a device: {', '.join(gpu_less)} "
                            "found no GPU for --device auto while others did; pass --device "
                            "cuda (and fix those hosts) or --device cpu")
    notes: list[str] = [share_gpu.note(size, share)] if share else []
    backend = _host_backend(backend_name, intra, watchdog, node_ranks.tolist())
    cuda_aware, aware_why = cuda_support() if dev.type == "cuda" else (False, "")
    device_backend, agreed = _device_route(backend_name, world, intra, watchdog,
                                           node_ranks.tolist(), dev, cuda_aware, notes, labels)
    if dev.type == "cuda" and cuda_aware and not agreed:
        notes.append("MPI is CUDA-aware here but not on every host: every rank stages "
                     "device tensors through host memory, so that all cut them alike")
    cuda_aware = agreed
    if dev.type == "cuda" and not cuda_aware and num_nodes > 1:
        notes.append(f"MPI is not CUDA-aware ({aware_why}): device tensors are staged "
                     "through pinned host memory; a CUDA-aware MPI (UCX) skips the copies")
    placement = summarize(labels)
    if base is None:
        launch_ranks = list(range(size))
    else:  # the survivors of a failure: their ranks at launch, for the messages
        launch_ranks = [int(r) for r in MPI.Group.Translate_ranks(
            world.Get_group(), list(range(size)), MPI.COMM_WORLD.Get_group())]
    link = device_host_link(backend_name, inter, watchdog, inter_ranks.tolist(), labels, dev,
                            node_sizes, device_backend is not None, notes)
    try:
        reducer = Reducer(world, inter, backend, watchdog, inter_ranks.tolist(), node_sizes,
                          int(bucket * 2**20), hier_algo, cuda_aware, device_backend, link)
    except ValueError as err:
        raise TopologyError(str(err)) from None
    errors = None
    if size > 1:
        with watchdog.guard("error communicator (Dup)"):
            errors = world.Dup()
    # The caller names its own phases (Topology.startup); a user's code has none.
    watchdog.phase, watchdog.activity = "", "starting up"
    topo = Topology(
        comm=world, intra=intra, inter=inter, rank=rank, size=size, local_rank=local_rank,
        local_size=local_size, node=node, num_nodes=num_nodes, node_sizes=node_sizes,
        emulated=rpn is not None, device=dev, timeout=watchdog.timeout,
        thread_level=thread_level,
        intra_backend=(device_backend or backend).name, cuda_aware=cuda_aware,
        node_ranks=node_ranks.tolist(), inter_ranks=inter_ranks.tolist(), watchdog=watchdog,
        reducer=reducer, _backend=backend, _mpi=MPI, host_rank=host_rank, host_size=host_size,
        placement=placement, hosts=[label.partition(":")[0] for label in labels], notes=notes,
        launch_ranks=launch_ranks, _errors=errors, pids=list(pids),
        _tracked=link.communicators() if link is not None else [],
    )
    log.info("hadpsgd.comm: %s", topo.describe())
    return topo
