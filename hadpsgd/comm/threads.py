"""An in-process world: N learners as threads of one process (:class:`ThreadJob`).

The second implementation of :class:`~hadpsgd.comm.World` beside MPI's ``Topology``: every
learner is a thread, a collective is a meeting at a barrier of its group (the world, a node,
the learners of one local rank across nodes) where each member leaves its value in a slot
and reads everyone's. It exists for the algorithms' numerical tests, which need the learners'
arithmetic and not processes: a launch of N ranks costs N imports of torch (5-7 s of CPU
each on the 2-core CI machine), a thread world costs nothing. The main command's trainer
runs on it too (``build_trainer`` with a :class:`ThreadWorld`: ``tests/trainer_threads.py``),
so tests of a whole run's numbers need no launch either. What only processes show (MPI
itself, kills, hangs, deadlines, the launcher, ULFM) stays under ``mpirun``.

Sums are taken in rank order in the tensor's dtype, the same on every member, so replicas
that must be identical are, bit for bit; a mean divides that sum by the group's size (MPI's
ring or tree may add in another order: compare with MPI at a tolerance, not bit for bit).
Objects cross by pickle, as MPI sends them, so no learner holds another's object.

The gossip's pair channel is a mailbox per ordered pair and tag, the pairing board and
ADPSGD's pool lock-guarded slots (:mod:`hadpsgd.comm.meetings`), so ADPSGD's gossip thread
runs here as it does under MPI. BMUF's side channel (overlapped and compressed block syncs)
and bf16 on the wire (``half_mean_``) run the MPI world's own code over meetings
(:mod:`hadpsgd.comm.thread_links`): the same bytes, sums and residuals. Deferred means do
not defer (they are for NCCL streams).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from hadpsgd.comm.compressed import CompressedMean, HierarchicalHalfMean, half_mean_in_
from hadpsgd.comm.deadline import CommTimeoutError
from hadpsgd.comm.meetings import Group, ThreadCounter, ThreadPairChannel, _made_together
from hadpsgd.comm.thread_links import ThreadComm, ThreadIntra, ThreadSideChannel, ThreadWatchdog
from hadpsgd.comm.world import ReduceOp

T = TypeVar("T")
THREAD_HOST = "threads"
"""The host name of every learner of a thread world (one process on one machine)."""


class ThreadWorld:
    """One learner's view of a :class:`ThreadJob`: a :class:`~hadpsgd.comm.World`."""

    def __init__(self, job: ThreadJob, rank: int) -> None:
        self._job = job
        self.rank, self.size = rank, job.size
        self.node, self.local_rank = divmod(rank, job.ranks_per_node)
        self.num_nodes = job.num_nodes
        self.node_sizes = [job.ranks_per_node] * job.num_nodes
        self.local_size = job.ranks_per_node
        self.device = torch.device("cpu")
        self.timeout = job.timeout
        self.launch_ranks = list(range(job.size))
        self.hosts = [THREAD_HOST] * job.size
        self.intra_backend = "threads"
        self.emulated = job.ranks_per_node < job.size  # nodes without hosts, as HADPSGD's
        self._what = "start-up"
        self._watchdog = ThreadWatchdog(job.timeout)
        self._hier_half: HierarchicalHalfMean | None = None
        self._half_means: dict[tuple[str, int, str], CompressedMean] = {}

    # -- the layout
    @property
    def thread_multiple(self) -> bool:
        """Threads may communicate beside the learner's own (the gossip thread does)."""
        return True

    @property
    def equal_nodes(self) -> bool:
        """Every node has :attr:`local_size` learners."""
        return True

    def require_equal_nodes(self, what: str) -> None:
        """Nodes are always equal here."""

    # -- what a stuck peer is told
    @contextlib.contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """While inside, ``what`` is this learner's activity (named when a meeting fails)."""
        before, self._what = self._what, what
        try:
            yield
        finally:
            self._what = before

    @contextlib.contextmanager
    def startup(self, phase: str) -> Iterator[None]:
        """``phase`` of the start-up, as :meth:`doing` (the trainer's assembly names them)."""
        with self.doing(f"starting up: {phase}"):
            yield

    def now_doing(self, what: str) -> None:
        """This learner's activity from now on."""
        self._what = what

    # -- collectives on tensors, in place
    def _reduce(self, group: Group, tensor: torch.Tensor, op: ReduceOp,
                what: str) -> torch.Tensor:
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        ThreadComm(group, self.rank).sum_(tensor, what)
        if op == "avg":
            tensor.div_(len(group.members))
        return tensor

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg",
                   path: Any = "auto") -> torch.Tensor:
        """The mean (or sum) over every learner (``path`` has one meaning here)."""
        return self._reduce(self._job.world, tensor, op, f"allreduce ({self._what})")

    def intra_allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg") -> torch.Tensor:
        """The mean (or sum) over this node's learners."""
        return self._reduce(self._job.nodes[self.node], tensor, op,
                            f"node allreduce ({self._what})")

    def inter_allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg") -> torch.Tensor:
        """The mean (or sum) over the learners of this local rank across nodes."""
        return self._reduce(self._job.across[self.local_rank], tensor, op,
                            f"inter-node allreduce ({self._what})")

    def _broadcast(self, group: Group, tensor: torch.Tensor, root: int,
                   what: str) -> torch.Tensor:
        seen = group.meet(self.rank, tensor.detach().clone(), what)
        tensor.copy_(seen[root])
        return tensor

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """``root``'s tensor on every learner."""
        return self._broadcast(self._job.world, tensor, root, f"broadcast ({self._what})")

    def intra_broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """The node's ``root`` (local rank) tensor on every learner of the node."""
        return self._broadcast(self._job.nodes[self.node], tensor, root,
                               f"node broadcast ({self._what})")

    def half_mean_(self, tensor: torch.Tensor, scope: str) -> int:
        """The mean over ``scope`` (``world`` or ``node``) with bf16 on the wire.

        As the MPI world's (:meth:`Topology.half_mean_`, the same code): across several
        nodes fp32 inside the node and bf16 between (each local rank its slice); inside one
        node bf16 shards. Returns the payload bytes this learner sent.
        """
        if scope not in ("world", "node"):
            raise ValueError(f"scope must be 'world' or 'node', got {scope!r}")
        job = self._job
        if scope == "world" and self.num_nodes > 1:
            if self._hier_half is None:
                self._hier_half = HierarchicalHalfMean(
                    ThreadComm(job.across[self.local_rank], self.rank), self._watchdog,
                    job.across[self.local_rank].members, size=self.size,
                    num_nodes=self.num_nodes, shard=True)
            intra = ThreadIntra(ThreadComm(job.nodes[self.node], self.rank), self._watchdog)
            return self._hier_half.mean_(tensor, intra)
        group = job.world if scope == "world" else job.nodes[self.node]
        return half_mean_in_(self._half_means, scope, ThreadComm(group, self.rank),
                             self._watchdog, group.members, tensor)  # type: ignore[arg-type]

    def mean_deferred_(self, tensor: torch.Tensor, scope: str) -> bool:
        """Nothing deferred (that is for NCCL streams): False, the caller averages now."""
        return False

    def deferrable(self, scope: str) -> bool:
        """Never: see :meth:`mean_deferred_`."""
        return False

    def join_deferred(self, host_wait: bool = True) -> None:
        """Nothing was deferred."""

    def settle_deferred(self) -> bool:
        """No wait was owed."""
        return False

    # -- channels and counters
    def pair_channel(self) -> ThreadPairChannel:
        """The gossip's channel over the learners of this local rank across nodes.

        The leaders' channel for local rank 0; collective over the world, as with MPI.
        """
        group = self._job.across[self.local_rank]
        channel = ThreadPairChannel(group, self.rank, self.timeout)
        self._job.world.meet(self.rank, None, "pair channel")  # every learner, in one order
        return channel

    def side_channel(self, wire: str = "fp32", background: bool = True) -> ThreadSideChannel:
        """A private cross-node channel (collective: every learner makes it).

        Its groups are its own (as MPI's duplicates), so ``background`` jobs run in a thread
        of this learner beside its own collectives.
        """
        job = self._job
        across, nodes = _made_together(job.world, self.rank, job.duplicate,
                                       "side channel set-up")
        inter = ThreadComm(across[self.local_rank], self.rank)
        intra = ThreadComm(nodes[self.node], self.rank) if self.local_size > 1 else None
        return ThreadSideChannel(inter, ThreadWatchdog(self.timeout),  # type: ignore[arg-type]
                                 inter.members, wire, background, intra=intra,
                                 node_ranks=nodes[self.node].members)

    def grad_pipeline(self) -> None:
        """No pipeline applies here."""
        return None

    def shared_counter(self, slots: int) -> ThreadCounter:
        """Counters every learner updates alone (collective: every learner makes it).

        As the MPI world's, on rank 0: another node's operations count as crossing nodes.
        """
        return ThreadCounter(self._job.world, self.rank, slots, crossing=self.node != 0)

    # -- objects and meetings
    def barrier(self) -> None:
        """Wait until every learner arrives."""
        self._job.world.meet(self.rank, None, f"barrier ({self._what})")

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every learner's object on every learner (each a copy, as MPI pickles them)."""
        seen = self._job.world.meet(self.rank, pickle.dumps(obj), f"allgather ({self._what})")
        return [pickle.loads(b) for b in seen]

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s object on every learner."""
        return self.allgather_object(obj if self.rank == root else None)[root]

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every learner's object on ``root`` (None elsewhere)."""
        every = self.allgather_object(obj)
        return every if self.rank == root else None

    # -- failures
    def every_rank_failed(self, message: str, wait_s: float = 3.0) -> list[str] | None:
        """One learner's own error only (the others' go up through :meth:`ThreadJob.run`)."""
        return [message] if self.size == 1 else None

    def check_revoked(self) -> None:
        """Nothing is revoked in a thread world."""

    def abort(self, code: int = 1) -> None:
        """Break every meeting, so no learner waits for this one; then raise."""
        self._job.break_all()
        raise RuntimeError(f"learner {self.rank} aborted the thread world (code {code})")


class ThreadJob:
    """N learners as threads: :meth:`run` calls a function once per learner.

    Args:
        size: Learners.
        ranks_per_node: Learners per node (super-learner), consecutive ranks; it must divide
            ``size``. Default: every learner its own node.
        timeout: Seconds a meeting waits for its last member before every member's call
            raises :class:`~hadpsgd.comm.CommTimeoutError` (a learner that failed, or a
            collective one learner skipped, ends the job instead of hanging it).
    """

    def __init__(self, size: int, ranks_per_node: int = 1, timeout: float = 60.0) -> None:
        if size < 1 or ranks_per_node < 1 or size % ranks_per_node:
            raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide size ({size}), "
                             "both >= 1")
        self.size, self.ranks_per_node, self.timeout = size, ranks_per_node, timeout
        self.num_nodes = size // ranks_per_node
        self.world = Group(list(range(size)), timeout)
        self.across, self.nodes = self._layout()
        self._duplicates: list[Group] = []

    def _layout(self) -> tuple[list[Group], list[Group]]:
        """New groups of the learners of each local rank across nodes, and of each node."""
        per, timeout = self.ranks_per_node, self.timeout
        across = [Group(list(range(j, self.size, per)), timeout) for j in range(per)]
        nodes = [Group(list(range(k * per, (k + 1) * per)), timeout)
                 for k in range(self.num_nodes)]
        return across, nodes

    def duplicate(self) -> tuple[list[Group], list[Group]]:
        """Groups of their own for a channel (MPI duplicates its communicators for one)."""
        across, nodes = self._layout()
        self._duplicates += across + nodes
        return across, nodes

    def break_all(self) -> None:
        """Break every group's barrier: whoever waits there raises at once."""
        for group in [self.world, *self.nodes, *self.across, *self._duplicates]:
            group.barrier.abort()

    def run(self, fn: Callable[[ThreadWorld], T]) -> list[T]:
        """``fn(world)`` on every learner, each on its own thread; the results by rank.

        Raises:
            BaseException: The first learner's error (by rank) after every thread ended; a
                learner that fails breaks every meeting, so the others end too.
        """
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def learner(rank: int) -> None:
            try:
                results[rank] = fn(ThreadWorld(self, rank))
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                errors[rank] = err
                self.break_all()

        threads = [threading.Thread(target=learner, args=(r,), name=f"learner-{r}")
                   for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first = next((e for e in errors if e is not None and not isinstance(
            e, CommTimeoutError)), None) or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


__all__ = ["ThreadJob", "ThreadWorld"]
