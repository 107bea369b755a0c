"""The channels a topology makes after start-up, each on duplicates of its communicators.

The gossip's pair channel, a side channel for reductions beside the main thread (BMUF's
overlap, the coarse averages), the gradient pipeline's and the shared counters: each a
collective over the world (every rank makes it, also those that will not use it), with its
own watchdog on its own control communicator where it waits beside the main thread, and
its communicators remembered so that a failure revokes them with the rest.
:class:`Channels` is that part of :class:`hadpsgd.comm.topology.Topology`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hadpsgd import env
from hadpsgd.comm.counter import SharedCounter
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.hierarchical import Reducer
from hadpsgd.comm.pair import PairChannel

if TYPE_CHECKING:
    from hadpsgd.comm.hostlink import HostLink
    from hadpsgd.comm.pipeline import GradPipeline
    from hadpsgd.comm.side import SideChannel


class Channels:
    """Makers of a topology's channels.

    A part of :class:`~hadpsgd.comm.topology.Topology`, whose fields below they read.
    """

    comm: Any
    intra: Any
    inter: Any
    size: int
    node: int
    local_size: int
    node_sizes: list[int]
    node_ranks: list[int]
    inter_ranks: list[int]
    timeout: float
    cuda_aware: bool
    thread_multiple: bool
    watchdog: Watchdog
    reducer: Reducer
    _pairs: PairChannel | None
    _tracked: list[Any]
    _links: list[Any]

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Send ``send`` to ``peer`` and receive ``peer``'s buffer into ``recv`` (gossip pair).

        Both sides must call it with the other's world rank; sizes and dtypes must match.
        It runs :meth:`PairChannel.exchange`, the path ADPSGD's gossip takes.
        """
        if self._pairs is None:
            self._pairs = PairChannel(self.comm, self.watchdog, list(range(self.size)),
                                      self.cuda_aware)
        self._pairs.exchange(send, recv, peer, tag)

    def pair_channel(self) -> PairChannel:
        """A private pair-exchange channel between super-learners, for a background thread.

        Collective over the world (every rank calls it, also those that will not use it):
        it duplicates the inter-node communicator (ranks = node indices) and gets its own
        watchdog on its own control communicator, since it waits concurrently with the
        main thread.
        """
        control, pairs = self._track(*self._dup("pair channel", self.comm, self.inter))
        watchdog = self._channel_watchdog(control, thread_multiple=True)
        # MPI only, also between super-learners that share a host: the gossip thread
        # launches no NCCL (comm/hostlink.py: *One thread launches NCCL*).
        return PairChannel(pairs, watchdog, self.inter_ranks, self.cuda_aware)

    def side_channel(self, wire: str = "fp32", background: bool = True) -> SideChannel:
        """A private cross-node channel whose reductions may run beside the main thread's.

        Collective over the world (every rank calls it): it duplicates the inter-node
        communicator and gets its own watchdog, like :meth:`pair_channel`. ``background``
        is honoured only under MPI_THREAD_MULTIPLE (see :mod:`hadpsgd.comm.side`).
        """
        from hadpsgd.comm.side import SideChannel  # noqa: PLC0415 - only BMUF's overlap needs it

        control, inter = self._track(*self._dup("side channel", self.comm, self.inter))
        intra = (self._track(*self._dup("side channel", self.intra))[0]
                 if self.local_size > 1 else None)
        watchdog = self._channel_watchdog(control, self.thread_multiple)
        threaded = background and self.thread_multiple
        # Super-learners of one that share a host: the channel's fp32 means take NCCL groups
        # of its own (the same layout agreed at start-up, so every member builds it), but
        # only where they run on the caller's thread (comm/hostlink.py: *One thread launches
        # NCCL*).
        link = (self._twin(inter, watchdog)
                if wire == "fp32" and max(self.node_sizes) == 1 and not threaded else None)
        return SideChannel(inter, watchdog, self.inter_ranks, wire, threaded,
                           intra=intra, node_ranks=self.node_ranks, link=link)

    def _channel_watchdog(self, control: Any, thread_multiple: bool) -> Watchdog:
        """A channel's own watchdog on its ``control``, asking the main one about silent peers.

        Past a deadline it names the peers that never arrived as the main watchdog does, and
        asks them on the main control communicator whether they are alive (its own has no
        monitor that answers), so that under ``--on-failure continue`` a frozen learner found
        by a channel's wait (a compressed block sync, the gossip) is killed from its host
        and the others go on, as on the main communicator.
        """
        watchdog = Watchdog(control, self.timeout, thread_multiple)
        watchdog.parent = self.watchdog
        return watchdog

    def _twin(self, comm: Any, watchdog: Watchdog) -> HostLink | None:
        """The host link's twin over a channel's duplicate ``comm`` (collective), or None.

        Its communicators are revoked with the rest after a failure, its groups released by
        :meth:`close`.
        """
        if self.reducer.host_link is None:
            return None
        link = self.reducer.host_link.twin(comm, watchdog)
        self._track(*link.communicators())
        self._links.append(link)
        return link

    def grad_pipeline(self) -> GradPipeline | None:
        """A pipeline for hierarchical gradient means, or None where none applies.

        Collective over the world (every rank calls it): it duplicates the inter-node
        communicator for the pipeline's thread, with its own watchdog. None (and nothing
        duplicated) without a hierarchical world, without MPI_THREAD_MULTIPLE, or with
        ``HADPSGD_PIPELINE_MB=0`` (see :mod:`hadpsgd.comm.pipeline`).
        """
        from hadpsgd.comm.pipeline import GradPipeline  # noqa: PLC0415 - hierarchical worlds only

        piece_mb = env.pipeline_mb()
        if not (self.reducer.hierarchical and self.thread_multiple and piece_mb > 0):
            return None
        control, inter = self._track(*self._dup("gradient pipeline", self.comm, self.inter))
        return GradPipeline(self.reducer, inter,
                            self._channel_watchdog(control, self.thread_multiple),
                            max(8, int(piece_mb * 2**20)))

    def shared_counter(self, slots: int) -> SharedCounter:
        """Counters every learner updates one-sidedly (collective: every rank calls it).

        They live on rank 0: a rank of another node counts its operations' bytes as
        crossing nodes (``crossing_bytes``).
        """
        return SharedCounter(self._track(*self._dup("shared counter", self.comm))[0],
                             self.watchdog, slots, crossing=self.node != 0)

    def _dup(self, what: str, *comms: Any) -> list[Any]:
        """Duplicates of ``comms``, each a blocking collective under the deadline."""
        copies = []
        for comm in comms:
            with self.watchdog.guard(f"communicator duplication for the {what} (Dup)"):
                copies.append(comm.Dup())
        return copies

    def _track(self, *comms: Any) -> tuple[Any, ...]:
        """Remember communicators made after start-up (see :meth:`communicators`)."""
        self._tracked.extend(comms)
        return comms


__all__ = ["Channels"]
