"""Intra-node backends on CPU: MPI collectives on the node communicator, or gloo.

Both sum in place on contiguous CPU tensors of a native dtype (the caller stages half
precision and device tensors). Every wait goes through the :class:`Watchdog`.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import uuid
from typing import Any

import torch

from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.objects import allgather_object, bcast_object


class IntraBackend:
    """Sum-reductions among the learners of one node.

    Attributes:
        name: ``mpi``, ``gloo`` or ``nccl``.
        size: Learners on the node.
        rank: This learner's rank on the node.
    """

    name = "base"
    scope = "intra-node"

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int],
                 scope: str = "intra-node") -> None:
        self.comm = comm
        self.scope = scope
        """What the group joins, for messages: ``intra-node``, or the super-learners of a
        host (:mod:`hadpsgd.comm.hostlink`)."""
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.watchdog = watchdog
        self.world_ranks = world_ranks
        """World ranks of the node's learners, by local rank (for error messages)."""

    def allreduce_(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the node in place."""
        raise NotImplementedError

    def reduce_scatter_(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Sum ``t`` (``size * out.numel()`` elements) over the node; shard ``rank`` to ``out``."""
        raise NotImplementedError

    def allgather_(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """Concatenate every learner's ``shard`` into ``out`` (in local-rank order)."""
        raise NotImplementedError

    def reduce_(self, t: torch.Tensor, root: int = 0) -> None:
        """Sum ``t`` over the node into local rank ``root``'s ``t``."""
        raise NotImplementedError

    def bcast_(self, t: torch.Tensor, root: int = 0) -> None:
        """Copy local rank ``root``'s ``t`` to every learner of the node."""
        raise NotImplementedError

    def close(self) -> None:
        """Release backend resources."""


_MPI: Any = None


def _mpi() -> Any:
    """The ``mpi4py.MPI`` module, imported on first use (MPI is initialised by then)."""
    global _MPI  # noqa: PLW0603 - a cache: the import statement costs ~0.4 us per call
    if _MPI is None:
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def _buf(t: torch.Tensor) -> Any:
    """What MPI reads and writes for ``t``: its NumPy view, or the device tensor itself.

    A device tensor reaches here only for a CUDA-aware MPI (the reducer stages it
    otherwise); MPI reads it outside every stream's order, so the host first waits for the
    work queued on it.
    """
    if t.is_cuda:
        from hadpsgd.comm.staging import wait_device

        wait_device(t.device)
        return t
    return t.numpy()


STORE_TIMEOUT_CAP_S = 30 * 86_400.0
"""The longest store timeout given to torch: ``HADPSGD_TIMEOUT=inf`` (no deadline) cannot
be a ``timedelta``, and 30 days is as good as none."""


def store_timeout(deadline_s: float) -> datetime.timedelta:
    """The timeout of a rendezvous store and of a torch process group for ``deadline_s``.

    That is hadpsgd's deadline (``HADPSGD_TIMEOUT``) itself, capped at
    :data:`STORE_TIMEOUT_CAP_S`.
    """
    return datetime.timedelta(seconds=min(float(deadline_s), STORE_TIMEOUT_CAP_S))


class MPIIntra(IntraBackend):
    """MPI collectives on the node communicator (shared-memory transport inside a node).

    Blocking calls (MPI's tuned algorithms) under the watchdog's guard; see
    :meth:`Watchdog.guard`. Host tensors go as NumPy views, device tensors as they are to a
    CUDA-aware MPI.
    """

    name = "mpi"

    def _guard(self, what: str) -> Any:
        return self.watchdog.guard(f"{self.scope} {what} (mpi)", self.world_ranks)

    def allreduce_(self, t: torch.Tensor) -> None:  # noqa: D102
        MPI = _mpi()  # noqa: N806 - the module

        with self._guard("allreduce"):
            self.comm.Allreduce(MPI.IN_PLACE, _buf(t), op=MPI.SUM)

    def reduce_scatter_(self, t: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        MPI = _mpi()  # noqa: N806 - the module

        with self._guard("reduce-scatter"):
            self.comm.Reduce_scatter_block(_buf(t), _buf(out), op=MPI.SUM)

    def allgather_(self, shard: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        with self._guard("allgather"):
            self.comm.Allgather(_buf(shard), _buf(out))

    def reduce_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        MPI = _mpi()  # noqa: N806 - the module
        buf = _buf(t)
        send = MPI.IN_PLACE if self.rank == root else buf
        with self._guard("reduce"):
            self.comm.Reduce(send, buf, op=MPI.SUM, root=root)

    def bcast_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        with self._guard("broadcast"):
            self.comm.Bcast(_buf(t), root=root)


class TorchIntra(IntraBackend):
    """A torch.distributed process group over the node (gloo on CPU, NCCL on GPUs).

    The rendezvous goes over MPI, never through environment variables: where the node's
    learners share one host (the usual case) through a FileStore whose path in the host's
    temp directory rank 0 picks and broadcasts; where they span hosts (a super-learner larger
    than a host, an emulated node across hosts, a round-robin rank mapping) through a TCP
    store that local rank 0 opens on a free port of its host and whose address it
    broadcasts (a FileStore in one host's ``/tmp`` would never be seen by the others).
    Either store waits ``HADPSGD_TIMEOUT`` (the watchdog's deadline, :func:`store_timeout`)
    for a peer's key, not torch's default of 5 minutes: a learner that never joins the group
    fails its peers' rendezvous at hadpsgd's deadline, like every other wait.
    Subclasses make the process group and say how to wait for one operation; the calls
    themselves are the same for both, so the CPU suite runs every one of them through gloo.
    """

    name = "torch"

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int],
                 scope: str = "intra-node") -> None:
        super().__init__(comm, watchdog, world_ranks, scope)
        import torch.distributed as dist

        self._dist = dist
        self._path: str | None = None
        self._tcp: Any = None
        self._listener: socket.socket | None = None
        timeout = store_timeout(watchdog.timeout)
        hosts = allgather_object(comm, watchdog, host_name(), group=world_ranks)
        self.rendezvous = "file" if len(set(hosts)) == 1 else "tcp"
        """``file`` (one host) or ``tcp`` (the node spans hosts)."""
        if self.rendezvous == "file":
            path = None
            if self.rank == 0:
                path = os.path.join(tempfile.gettempdir(),
                                    f"hadpsgd-{self.name}-{uuid.uuid4().hex}")
            path = bcast_object(comm, watchdog, path, root=0, group=world_ranks)
            self._path = path
            base = dist.FileStore(path, self.size)
            base.set_timeout(timeout)  # torch's default otherwise (the TCP store gets it made)
        else:
            base = self._tcp_store(hosts[0], [h for h in hosts if h != hosts[0]], timeout)
        self.store = base
        """The rendezvous store (FileStore or TCPStore); its ``timeout`` is the deadline."""
        store = dist.PrefixStore(f"hadpsgd-intra-{self.name}", base)
        self.pg = self._make_group(store, timeout)

    def _tcp_store(self, leader_host: str, peers: list[str],
                   timeout: datetime.timedelta) -> Any:
        """A TCP store served by local rank 0 on a free port; its address goes over MPI.

        The store has no authentication, so it listens only on the address through which
        this host reaches the node's other hosts (:func:`facing_address`), not on every
        interface; where that address cannot be found it listens as torch does (all) and
        the address is the host's name.
        """
        dist = self._dist
        address = None
        if self.rank == 0:
            listener = listening_socket(peers)
            host = leader_host if listener is None else listener.getsockname()[0]
            # Port 0: the OS picks a free one, so two jobs on one host never collide.
            self._tcp = dist.TCPStore(
                host, 0 if listener is None else listener.getsockname()[1], self.size, True,
                timeout=timeout, wait_for_workers=False,
                master_listen_fd=None if listener is None else listener.fileno())
            self._listener = listener  # the store serves on it: keep it open with the store
            address = (host, int(self._tcp.port))
        host, port = bcast_object(self.comm, self.watchdog, address, root=0,
                                  group=self.world_ranks)
        if self.rank == 0:
            return self._tcp
        with self.watchdog.guard(f"TCP store rendezvous with {host}:{port}",
                                 self.world_ranks[:1]):
            return dist.TCPStore(host, port, self.size, False, timeout=timeout)

    def _make_group(self, store: Any, timeout: datetime.timedelta) -> Any:
        """The process group on ``store``; ``timeout`` is :func:`store_timeout`'s."""
        raise NotImplementedError

    def _wait(self, work: Any, what: str) -> None:
        raise NotImplementedError

    def _admit(self, *tensors: torch.Tensor) -> None:
        """Refuse tensors this process group cannot take (before anything is sent)."""

    def allreduce_(self, t: torch.Tensor) -> None:  # noqa: D102
        self._admit(t)
        self._wait(self.pg.allreduce([t]), "allreduce")

    def reduce_scatter_(self, t: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        self._admit(t, out)
        self._wait(self.pg._reduce_scatter_base(out, t), "reduce-scatter")

    def allgather_(self, shard: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        self._admit(shard, out)
        self._wait(self.pg._allgather_base(out, shard), "allgather")

    def reduce_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        self._admit(t)
        opts = self._dist.ReduceOptions()
        opts.rootRank = root
        self._wait(self.pg.reduce([t], opts), "reduce")

    def bcast_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        self._admit(t)
        opts = self._dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self.pg.broadcast([t], opts), "broadcast")

    def close(self) -> None:  # noqa: D102
        if self.rank == 0 and self._path and os.path.exists(self._path):
            try:
                os.unlink(self._path)
            except OSError:
                pass


def facing_address(peer_host: str) -> tuple[int, str] | None:
    """(family, address) of this host's interface that routes to ``peer_host``, or None.

    A UDP "connect" sends nothing: it only asks the kernel which local address a packet to
    the peer would leave from. That is the interface the job's traffic to that host takes.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            local = probe.getsockname()[0]
    except OSError:
        return None
    return family, local


def listening_socket(peers: list[str]) -> socket.socket | None:
    """A socket listening on a free port of the interface facing ``peers``, or None."""
    found = facing_address(peers[0]) if peers else None
    if found is None:
        return None
    family, local = found
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((local, 0))
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock


def host_name() -> str:
    """This host's name as the other hosts of the job reach it (for the TCP rendezvous)."""
    return socket.gethostname()


class GlooIntra(TorchIntra):
    """torch.distributed's gloo on the node (CPU tensors)."""

    name = "gloo"

    def _make_group(self, store: Any, timeout: datetime.timedelta) -> Any:
        return self._dist.ProcessGroupGloo(store, self.rank, self.size, timeout)

    def _wait(self, work: Any, what: str) -> None:
        # Some gloo operations only run inside wait(), so completion cannot be polled; gloo's
        # own timeout bounds the wait and the watchdog then names the missing peers.
        self.watchdog.seq += 1
        try:
            work.wait(store_timeout(self.watchdog.timeout))
        except RuntimeError:
            self.watchdog.fail(f"{self.scope} {what} (gloo)", self.world_ranks)
