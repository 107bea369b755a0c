"""The thread world's communicators for the compressed means and BMUF's side channel.

What :mod:`hadpsgd.comm.threads` hands the MPI world's own code.

:class:`~hadpsgd.comm.compressed.CompressedMean`, :class:`~hadpsgd.comm.compressed.
HierarchicalHalfMean` and :class:`~hadpsgd.comm.side.SideChannel` talk to mpi4py
communicators (``Alltoall``, ``Allgather``, their non-blocking twins, ``Allreduce``), to an
intra-node backend and to a watchdog. Here those are meetings of a
:class:`~hadpsgd.comm.meetings.Group`: :class:`ThreadComm`, :class:`ThreadIntra` and
:class:`ThreadWatchdog`. So the thread world runs the very codec and two-stage exchange of
the MPI world (the same encoded bytes, the same node-order sums, the same residuals), and
BMUF's overlapped and compressed block syncs and ``--grad-wire bf16`` are tested on learners
as threads with no launch. What the MPI path adds (its own collectives, the deadlines of
non-blocking requests, NCCL twins) stays under mpirun.

A side channel's groups are its own (:meth:`ThreadJob.duplicate`), as MPI's side channel
duplicates its communicators: its jobs may run in a background thread of each learner while
the learner's own collectives go on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from hadpsgd.comm.backends import IntraBackend
from hadpsgd.comm.meetings import Group, _Watchdog
from hadpsgd.comm.side import SideChannel


class _Done:
    """A request that completed when it was made (a meeting has already happened)."""

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return True

    def Wait(self) -> None:  # noqa: N802 - mpi4py's name
        """Nothing to wait for."""


class ThreadWatchdog(_Watchdog):
    """The calls the channels make on their :class:`~hadpsgd.comm.deadline.Watchdog`.

    A meeting waits at most its group's timeout and then raises
    :class:`~hadpsgd.comm.CommTimeoutError` naming who never arrived, so there is nothing to
    watch: a guard is empty and a request is done when it is made.
    """

    def guard(self, what: str, group: list[int] | None = None) -> contextlib.AbstractContextManager:
        """Nothing to watch (the meeting has its deadline)."""
        return contextlib.nullcontext()

    def wait(self, request: Any, what: str, group: list[int] | None = None) -> None:
        """The request is done (see :class:`_Done`)."""

    def stop(self) -> None:
        """No monitor thread to stop."""


class ThreadComm:
    """The mpi4py buffer collectives a compressed mean calls, over a :class:`Group`.

    Its rank is the learner's place in the group (the node index for the learners of one
    local rank across nodes), as an MPI communicator's. Buffers are NumPy arrays (what the
    callers hand MPI); sums run in member order, the same on every member.
    """

    def __init__(self, group: Group, world_rank: int) -> None:
        self.group, self.world_rank = group, world_rank
        self.members = list(group.members)
        self._rank = self.members.index(world_rank)

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        """Members of the group."""
        return len(self.members)

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        """This learner's place in the group."""
        return self._rank

    def _meet(self, value: Any, what: str) -> list[Any]:
        return self.group.meet(self.world_rank, value, what)

    def Alltoall(self, send: np.ndarray, recv: np.ndarray) -> None:  # noqa: N802
        """Piece ``k`` of ``send`` to member ``k``; member ``k``'s piece for us at ``k``."""
        seen = self._meet(np.array(send, copy=True).reshape(-1), "all-to-all")
        n, out = len(seen), recv.reshape(-1)
        piece = out.size // n
        mine = slice(self._rank * piece, (self._rank + 1) * piece)
        for k, theirs in enumerate(seen):
            out[k * piece:(k + 1) * piece] = theirs[mine]

    def Allgather(self, send: np.ndarray, recv: np.ndarray) -> None:  # noqa: N802
        """Every member's ``send``, in member order, into ``recv``."""
        seen = self._meet(np.array(send, copy=True).reshape(-1), "allgather")
        recv.reshape(-1)[:] = np.concatenate(seen)

    def Ialltoall(self, send: np.ndarray, recv: np.ndarray) -> _Done:  # noqa: N802
        """:meth:`Alltoall`, done when it returns."""
        self.Alltoall(send, recv)
        return _Done()

    def Iallgather(self, send: np.ndarray, recv: np.ndarray) -> _Done:  # noqa: N802
        """:meth:`Allgather`, done when it returns."""
        self.Allgather(send, recv)
        return _Done()

    def sum_(self, flat: torch.Tensor, what: str) -> None:
        """The sum of ``flat`` over the group, in member order, in place."""
        seen = self._meet(flat.detach().clone(), what)
        total = seen[0].clone()
        for other in seen[1:]:
            total += other
        flat.copy_(total)


class ThreadIntra(IntraBackend):
    """A node's sums among its learner threads (the intra-node backend of a thread world)."""

    name = "threads"

    def __init__(self, comm: ThreadComm, watchdog: ThreadWatchdog) -> None:
        super().__init__(comm, watchdog, comm.members)  # type: ignore[arg-type]
        self._comm = comm

    def allreduce_(self, t: torch.Tensor) -> None:  # noqa: D102
        self._comm.sum_(t, f"{self.scope} allreduce (threads)")

    def reduce_scatter_(self, t: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        total = t.clone()
        self._comm.sum_(total, f"{self.scope} reduce-scatter (threads)")
        out.copy_(total.view(self.size, -1)[self.rank])

    def allgather_(self, shard: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        seen = self._comm._meet(shard.detach().clone(), f"{self.scope} allgather (threads)")
        out.copy_(torch.cat([s.reshape(-1) for s in seen]).view_as(out))

    def reduce_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        total = t.clone()
        self._comm.sum_(total, f"{self.scope} reduce (threads)")
        if self.rank == root:
            t.copy_(total)

    def bcast_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        seen = self._comm._meet(t.detach().clone(), f"{self.scope} broadcast (threads)")
        t.copy_(seen[root])


class ThreadSideChannel(SideChannel):
    """BMUF's side channel over a side channel's own groups (see the module's text).

    Every wire takes the MPI world's code: a compressed wire (or several learners a node)
    :class:`~hadpsgd.comm.compressed.CompressedMean` over :class:`ThreadComm`; fp32 with one
    learner a node a sum in node order, then the mean. Jobs run in a background thread of
    the learner when ``background``, else when waited for, as under MPI.
    """

    def _host_sum_(self, comm: Any, flat: torch.Tensor, what: str, group: list[int]) -> None:
        comm.sum_(flat, what)


__all__ = ["ThreadComm", "ThreadIntra", "ThreadSideChannel", "ThreadWatchdog"]
