"""Topology discovery and the collectives on flat tensors (contract: ``hadpsgd.comm``)."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from hadpsgd.comm.deadline import timeout_from_env, wait
from hadpsgd.comm.mpi import as_mpi_array, check_thread_level, mpi

ReduceOp = Literal["avg", "sum"]


class TopologyError(ValueError):
    """A process layout that cannot work (bad ``ranks_per_node``, unequal nodes, ...)."""


@dataclass
class Topology:
    """Where this learner sits and how it talks to the others.

    Attributes:
        comm: The world communicator (all learners).
        intra: Communicator of the learners on this (possibly emulated) node.
        inter: Communicator of the learners with the same ``local_rank`` across nodes.
        rank: Rank in ``comm``.
        size: Number of learners.
        local_rank: Rank inside the node.
        local_size: Learners on this node.
        node: Index of this node (super-learner).
        num_nodes: Number of nodes (super-learners).
        node_sizes: Learners per node, by node index.
        emulated: True when nodes are emulated by ``ranks_per_node``.
        device: The torch device this learner computes on.
        timeout: Deadline in seconds of every blocking wait.
        thread_level: MPI thread level granted.
    """

    comm: Any
    intra: Any
    inter: Any
    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    node_sizes: list[int]
    emulated: bool
    device: torch.device
    timeout: float
    thread_level: int
    _mpi: Any = field(repr=False, default=None)

    # ------------------------------------------------------------------ layout checks
    @property
    def equal_nodes(self) -> bool:
        """Whether every node holds the same number of learners."""
        return len(set(self.node_sizes)) == 1

    def require_equal_nodes(self, what: str) -> None:
        """Raise a :class:`TopologyError` naming ``what`` if node sizes differ."""
        if not self.equal_nodes:
            raise TopologyError(
                f"{what} needs nodes of equal size, but the {self.size} ranks form nodes of "
                f"sizes {self.node_sizes}; launch a multiple of --ranks-per-node ranks"
            )

    # ------------------------------------------------------------------ collectives
    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg") -> torch.Tensor:
        """Reduce ``tensor`` in place over all learners (``avg`` or ``sum``) and return it.

        One MPI message per call: callers pass flat buffers (see :mod:`hadpsgd.comm.flat`).
        """
        if op not in ("avg", "sum"):
            raise ValueError(f"allreduce_: op must be 'avg' or 'sum', got {op!r}")
        if self.size > 1:
            buf, staged = as_mpi_array(tensor)
            req = self.comm.Iallreduce(self._mpi.IN_PLACE, buf, op=self._mpi.SUM)
            wait(req, self.timeout, f"allreduce of {tensor.numel()} {tensor.dtype} on rank "
                 f"{self.rank} (world of {self.size})")
            if staged is not None:
                tensor.copy_(staged)
        if op == "avg" and self.size > 1:
            tensor.div_(self.size)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every learner with ``root``'s and return it."""
        if self.size > 1:
            buf, staged = as_mpi_array(tensor)
            req = self.comm.Ibcast(buf, root=root)
            wait(req, self.timeout, f"broadcast of {tensor.numel()} {tensor.dtype} from rank "
                 f"{root} to rank {self.rank}")
            if staged is not None:
                tensor.copy_(staged)
        return tensor

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Send ``send`` to ``peer`` and receive ``peer``'s buffer into ``recv`` (gossip pair).

        Both sides must call it with the other's rank; sizes and dtypes must match.
        """
        sbuf, _ = as_mpi_array(send)
        rbuf, staged = as_mpi_array(recv)
        reqs = [self.comm.Irecv(rbuf, source=peer, tag=tag), self.comm.Isend(sbuf, dest=peer,
                                                                            tag=tag)]
        for req in reqs:
            wait(req, self.timeout, f"pair exchange between ranks {self.rank} and {peer}")
        if staged is not None:
            recv.copy_(staged)

    def barrier(self) -> None:
        """Wait until every learner arrives (with the deadline)."""
        if self.size > 1:
            wait(self.comm.Ibarrier(), self.timeout, f"barrier on rank {self.rank}")

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root`` (with the deadline) and return it."""
        if self.size == 1:
            return obj
        payload = pickle.dumps(obj) if self.rank == root else b""
        length = np.array([len(payload)], dtype=np.int64)
        wait(self.comm.Ibcast(length, root=root), self.timeout, "object broadcast (length)")
        data = np.frombuffer(payload, dtype=np.uint8).copy() if self.rank == root else \
            np.empty(int(length[0]), dtype=np.uint8)
        wait(self.comm.Ibcast(data, root=root), self.timeout, "object broadcast (payload)")
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every learner onto every learner."""
        if self.size == 1:
            return [obj]
        return [self.bcast_object(obj, root=r) for r in range(self.size)]

    def abort(self, code: int = 1) -> None:
        """Abort the whole job (every rank), used when an error would otherwise hang peers."""
        self.comm.Abort(code)


def _resolve_ranks_per_node(ranks_per_node: int | None) -> int | None:
    if ranks_per_node is None:
        raw = os.environ.get("HADPSGD_RANKS_PER_NODE", "").strip()
        if raw:
            try:
                ranks_per_node = int(raw)
            except ValueError:
                raise TopologyError(
                    f"HADPSGD_RANKS_PER_NODE={raw!r} is not an integer; set it to the number of "
                    "consecutive ranks that form one emulated node, or unset it"
                ) from None
    if ranks_per_node is not None and ranks_per_node < 1:
        raise TopologyError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return ranks_per_node


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TopologyError(
                f"device={device!r} was asked for but CUDA is not available; use --device cpu"
            )
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    raise TopologyError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def init(ranks_per_node: int | None = None, device: str = "auto") -> Topology:
    """Initialise MPI, discover (or emulate) nodes and build the communicators.

    Args:
        ranks_per_node: Emulate nodes of this many consecutive ranks (also env
            ``HADPSGD_RANKS_PER_NODE``); ``None`` uses the real nodes from
            ``Split_type(COMM_TYPE_SHARED)``.
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.

    Returns:
        The :class:`Topology` of this learner.

    Raises:
        TopologyError: For an impossible layout or device request.
    """
    MPI = mpi()  # noqa: N806 - conventional name of the module
    thread_level = check_thread_level(MPI)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    host = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    host_size = host.Get_size()

    rpn = _resolve_ranks_per_node(ranks_per_node)
    if rpn is not None:
        if rpn > size:
            raise TopologyError(
                f"ranks_per_node={rpn} is larger than the {size} launched ranks; launch at least "
                f"{rpn} ranks or lower --ranks-per-node"
            )
        host.Free()
        node = rank // rpn
        intra = world.Split(color=node, key=rank)
        num_nodes = (size + rpn - 1) // rpn
        node_sizes = [min(rpn, size - n * rpn) for n in range(num_nodes)]
    else:
        intra = host
        # Number the nodes by their leaders' world ranks, so node indices are stable.
        is_leader = intra.Get_rank() == 0
        leaders = world.Split(color=0 if is_leader else MPI.UNDEFINED, key=rank)
        node = leaders.Get_rank() if is_leader else -1
        if is_leader:
            leaders.Free()
        node = intra.bcast(node, root=0)
        node_sizes_by_rank = world.allgather((node, intra.Get_size()))
        num_nodes = max(n for n, _ in node_sizes_by_rank) + 1
        node_sizes = [0] * num_nodes
        for n, s in node_sizes_by_rank:
            node_sizes[n] = s
    local_rank, local_size = intra.Get_rank(), intra.Get_size()
    inter = world.Split(color=local_rank, key=node)

    dev = _resolve_device(device, local_rank)
    if dev.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a machine would otherwise each start one thread per core and thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // host_size))
    return Topology(
        comm=world, intra=intra, inter=inter, rank=rank, size=size, local_rank=local_rank,
        local_size=local_size, node=node, num_nodes=num_nodes, node_sizes=node_sizes,
        emulated=rpn is not None, device=dev, timeout=timeout_from_env(),
        thread_level=thread_level, _mpi=MPI,
    )
