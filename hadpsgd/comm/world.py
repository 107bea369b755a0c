"""The communication face the algorithms, the loop and the API see: a :class:`World`.

:class:`~hadpsgd.comm.Topology` (MPI, NCCL, gloo) has 37 members, most of them for the
comm layer's own use (its communicators, watchdog, reducer, backends). What
``hadpsgd.algorithms``, ``hadpsgd.train`` and ``hadpsgd.api`` call of it is written down
here, and they are typed against this protocol, not the class: a second world (learners as
threads in one process, for the numerical tests; a fault-injecting wrapper) then needs only
these members. ``tests/unit/test_world.py`` holds both sides to it: every member here exists
on ``Topology`` with the same parameters, and those three packages reach no member of a
world outside it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

if TYPE_CHECKING:
    from hadpsgd.comm.counter import SharedCounter
    from hadpsgd.comm.hierarchical import ReducePath
    from hadpsgd.comm.pair import PairChannel
    from hadpsgd.comm.pipeline import GradPipeline
    from hadpsgd.comm.side import SideChannel

ReduceOp = Literal["avg", "sum"]


class World(Protocol):
    """The learners of one job, as this learner sees them (read-only to its users)."""

    # -- who and where
    @property
    def rank(self) -> int:
        """This learner's rank among :attr:`size`."""

    @property
    def size(self) -> int:
        """Number of learners."""

    @property
    def local_rank(self) -> int:
        """Rank inside this learner's node (super-learner)."""

    @property
    def local_size(self) -> int:
        """Learners on this node."""

    @property
    def node(self) -> int:
        """Index of this node."""

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""

    @property
    def node_sizes(self) -> list[int]:
        """Learners per node, by node index."""

    @property
    def device(self) -> torch.device:
        """The torch device this learner computes on."""

    @property
    def timeout(self) -> float:
        """Deadline in seconds of every blocking wait."""

    @property
    def launch_ranks(self) -> list[int]:
        """Every learner's rank at launch (they differ from :attr:`rank` after a shrink)."""

    # -- the layout
    @property
    def thread_multiple(self) -> bool:
        """Whether threads may communicate beside the main thread (gossip, side syncs)."""

    @property
    def equal_nodes(self) -> bool:
        """Whether every node has as many learners."""

    def require_equal_nodes(self, what: str) -> None:
        """Refuse ``what`` (naming it) where nodes differ in size."""

    # -- what a stuck peer is told
    def doing(self, what: str) -> contextlib.AbstractContextManager[None]:
        """While inside, ``what`` is this learner's current activity."""

    def now_doing(self, what: str) -> None:
        """This learner's current activity from now on."""

    # -- collectives on tensors, in place
    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg",
                   path: ReducePath = "auto") -> torch.Tensor:
        """The mean (or sum) over every learner."""

    def intra_allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg") -> torch.Tensor:
        """The mean (or sum) over this node's learners."""

    def inter_allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg") -> torch.Tensor:
        """The mean (or sum) over the learners of this local rank across nodes."""

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """``root``'s tensor on every learner."""

    def intra_broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """The node's ``root`` (local rank) tensor on every learner of the node."""

    def half_mean_(self, tensor: torch.Tensor, scope: str) -> int:
        """The mean over ``scope`` with bf16 on the wire; returns the bytes sent."""

    def mean_deferred_(self, tensor: torch.Tensor, scope: str) -> bool:
        """Start the mean over ``scope`` to finish at :meth:`join_deferred`; False: done now."""

    def deferrable(self, scope: str) -> bool:
        """Whether :meth:`mean_deferred_` over ``scope`` can defer."""

    def join_deferred(self, host_wait: bool = True) -> None:
        """Finish every deferred mean."""

    def settle_deferred(self) -> bool:
        """Finish what the deferred means left in flight; whether anything was."""

    # -- channels for threads and one-sided counters (collective: every learner calls them)
    def pair_channel(self) -> PairChannel:
        """The gossip's channel: pairwise exchanges between node leaders."""

    def side_channel(self, wire: str = "fp32", background: bool = True) -> SideChannel:
        """A channel for means in the background (BMUF's overlapped syncs)."""

    def grad_pipeline(self) -> GradPipeline | None:
        """A pipeline for hierarchical gradient means, or None where none applies."""

    def shared_counter(self, slots: int) -> SharedCounter:
        """Counters every learner updates one-sidedly (ADPSGD's pool)."""

    # -- objects and meetings
    def barrier(self) -> None:
        """Wait until every learner arrives."""

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s picklable object on every learner."""

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every learner's object on ``root`` (None elsewhere)."""

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every learner's object on every learner."""

    # -- failures
    def every_rank_failed(self, message: str, wait_s: float = 3.0) -> list[str] | None:
        """Every learner's error message if every learner failed before training."""

    def check_revoked(self) -> None:
        """Raise if a peer revoked the world after a failure."""

    def abort(self, code: int = 1) -> None:
        """End the whole job."""


__all__ = ["ReduceOp", "World"]
