"""Intra-node backends on CPU: MPI collectives on the node communicator, or gloo.

Both sum in place on contiguous CPU tensors of a native dtype (the caller stages half
precision and device tensors). Every wait goes through the :class:`Watchdog`.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import uuid
from typing import Any

import torch

from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.objects import bcast_object


class IntraBackend:
    """Sum-reductions among the learners of one node.

    Attributes:
        name: ``mpi``, ``gloo`` or ``nccl``.
        size: Learners on the node.
        rank: This learner's rank on the node.
    """

    name = "base"

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int]) -> None:
        self.comm = comm
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


class MPIIntra(IntraBackend):
    """MPI collectives on the node communicator (shared-memory transport inside a node).

    Blocking calls (MPI's tuned algorithms) under the watchdog's guard; see
    :meth:`Watchdog.guard`.
    """

    name = "mpi"

    def _guard(self, what: str) -> Any:
        return self.watchdog.guard(f"intra-node {what} (mpi)", self.world_ranks)

    def allreduce_(self, t: torch.Tensor) -> None:  # noqa: D102
        MPI = _mpi()  # noqa: N806 - the module

        with self._guard("allreduce"):
            self.comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)

    def reduce_scatter_(self, t: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        MPI = _mpi()  # noqa: N806 - the module

        with self._guard("reduce-scatter"):
            self.comm.Reduce_scatter_block(t.numpy(), out.numpy(), op=MPI.SUM)

    def allgather_(self, shard: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        with self._guard("allgather"):
            self.comm.Allgather(shard.numpy(), out.numpy())

    def reduce_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        MPI = _mpi()  # noqa: N806 - the module
        buf = t.numpy()
        send = MPI.IN_PLACE if self.rank == root else buf
        with self._guard("reduce"):
            self.comm.Reduce(send, buf, op=MPI.SUM, root=root)

    def bcast_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        with self._guard("broadcast"):
            self.comm.Bcast(t.numpy(), root=root)


class TorchIntra(IntraBackend):
    """A torch.distributed process group over the node (gloo on CPU, NCCL on GPUs).

    The rendezvous goes through a FileStore whose path rank 0 picks and broadcasts over MPI
    (no TCP store, no environment variables; a node's learners share its temp directory).
    Subclasses make the process group and say how to wait for one operation; the calls
    themselves are the same for both, so the CPU suite runs every one of them through gloo.
    """

    name = "torch"

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int]) -> None:
        super().__init__(comm, watchdog, world_ranks)
        import torch.distributed as dist

        self._dist = dist
        path = None
        if self.rank == 0:
            path = os.path.join(tempfile.gettempdir(),
                                f"hadpsgd-{self.name}-{uuid.uuid4().hex}")
        path = bcast_object(comm, watchdog, path, root=0, group=world_ranks)
        self._path = path
        store = dist.PrefixStore(f"hadpsgd-intra-{self.name}", dist.FileStore(path, self.size))
        self.pg = self._make_group(store, datetime.timedelta(seconds=watchdog.timeout))

    def _make_group(self, store: Any, timeout: datetime.timedelta) -> Any:
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
            work.wait(datetime.timedelta(seconds=self.watchdog.timeout))
        except RuntimeError:
            self.watchdog.fail(f"intra-node {what} (gloo)", self.world_ranks)
