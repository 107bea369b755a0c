"""The pair-exchange channel: two learners swap equal-sized buffers, with a deadline.

ADPSGD's gossip thread and ``python -m benchmarks.comm --op exchange`` both go through
:class:`PairChannel`, so the benchmark times the path training takes. Device buffers are
staged through pinned host memory unless MPI is CUDA-aware; half precision goes as raw bytes
(nothing is reduced, so no MPI type is needed). A staged send is one copy off the device on
the caller's stream and one sleeping wait for it; a staged receive is one copy onto the
device on that stream, which the host does not wait for: the next exchange waits for it
(usually long done) only before MPI writes the host buffer again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hadpsgd.comm.counter import OwnedSlots
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.mpi import MPI_NATIVE
from hadpsgd.comm.staging import Stager, wait_device


class PairRequest:
    """A non-blocking agreement over a :class:`PairChannel` in flight (a barrier)."""

    def __init__(self, request: Any) -> None:
        self._request = request
        self._done = False

    def done(self) -> bool:
        """Whether it completed (tests without blocking)."""
        if not self._done:
            self._done = bool(self._request.Test())
        return self._done


class PairChannel:
    """Pairwise exchanges over one communicator, waited on by one watchdog.

    Args:
        comm: The communicator (its ranks are the peers' indices).
        watchdog: Deadline keeper of the thread that uses this channel.
        world_ranks: World rank of each of ``comm``'s ranks (for error messages).
        cuda_aware: Whether MPI accepts device buffers.
        stager: Host buffers for device tensors (a channel's own: it may run in a thread).
    """

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int],
                 cuda_aware: bool = False, stager: Stager | None = None) -> None:
        self.comm = comm
        self.watchdog = watchdog
        self.world_ranks = world_ranks
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.cuda_aware = cuda_aware
        self.stager = stager or Stager()
        self._landed: Any = None  # the last staged receive's copy onto the device (an event)

    def _wire(self, t: torch.Tensor, slot: int) -> tuple[Any, torch.Tensor | None]:
        """What MPI sends from / receives into for ``t``, and the host copy if one is used."""
        if t.is_cuda and not (self.cuda_aware and t.dtype in MPI_NATIVE):
            host = self.stager.buffer(t.dtype, t.numel(), slot=slot)
            return _bytes(host), host
        if t.is_cuda:
            wait_device(t.device)
            return t, None
        return _bytes(t), None

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0,
                 what: str | None = None, progress: Callable[[], None] | None = None) -> None:
        """Send ``send`` to ``peer`` and receive ``peer``'s buffer into ``recv``.

        Both sides call it with the other's rank; sizes and dtypes must match.

        Args:
            send: Contiguous buffer to send.
            recv: Contiguous buffer of the same size and dtype, overwritten.
            peer: The partner's rank in this channel.
            tag: Message tag (both sides use the same).
            what: Description for a timeout error.
            progress: Called while waiting (keeps other non-blocking work moving).
        """
        if send.numel() != recv.numel() or send.dtype != recv.dtype:
            raise ValueError("exchange: send and recv must have the same size and dtype")
        sbuf, shost = self._wire(send, slot=3)
        rbuf, rhost = self._wire(recv, slot=4)
        if self._landed is not None:  # MPI overwrites the host buffer the last copy read
            self._landed.synchronize()
            self._landed = None
        if shost is not None:
            _to_host(send, shost)
        reqs = [self.comm.Irecv(rbuf, source=peer, tag=tag),
                self.comm.Isend(sbuf, dest=peer, tag=tag)]
        what = what or (f"pair exchange of {send.numel()} {send.dtype} between ranks "
                        f"{self.world_ranks[self.rank]} and {self.world_ranks[peer]}")
        self.watchdog.wait_all(reqs, what, [self.world_ranks[peer]], progress=progress)
        if rhost is not None:
            self._landed = _from_host(rhost, recv)

    def board(self, slots: int) -> OwnedSlots:
        """A pairing board: one slot per rank of the channel, in that rank's own memory.

        Collective over the channel. ``slots`` must be the channel's size (one per
        super-learner); each rank of the channel is a node of its own.
        """
        if slots != self.size:
            raise ValueError(f"a pairing board has one slot per rank of the channel "
                             f"({self.size}), got {slots}")
        return OwnedSlots(self.comm.Dup(), self.watchdog)

    def start_barrier(self) -> PairRequest:
        """Begin a non-blocking barrier over the channel."""
        return PairRequest(self.comm.Ibarrier())


def _to_host(t: torch.Tensor, host: torch.Tensor) -> None:
    """Copy device ``t`` into pinned ``host`` on the current stream; the host sleeps until done.

    A plain blocking copy would spin a core in the CUDA runtime for as long as the stream's
    earlier work takes; a blocking-sync event puts the thread to sleep instead.
    """
    stream = torch.cuda.current_stream(t.device)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    event.synchronize()


def _from_host(host: torch.Tensor, t: torch.Tensor) -> Any:
    """Queue the copy of pinned ``host`` into device ``t`` on the current stream.

    What that stream does next sees ``t``; the host does not wait. Returns the event that
    tells when ``host`` may be written again.
    """
    stream = torch.cuda.current_stream(t.device)
    t.copy_(host, non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's memory as bytes for MPI (works for dtypes NumPy lacks, e.g. bf16)."""
    return t.view(torch.uint8).numpy()
