"""Hierarchical gradient sums whose phases run in a pipeline across pieces.

A hierarchical sum of one piece has three phases: inside the node (reduce-scatter, or reduce
to the leader), between the nodes (an MPI allreduce of the shard), inside the node again
(allgather, or broadcast from the leader). :class:`hadpsgd.comm.hierarchical.Reducer` runs
them one after another, piece after piece, so the link between the nodes idles while the
node reduces and the node idles while the link carries: most of a stacked LSTM's gradients
are released at the end of backward (issue 44), and then every piece waits for the one
before it, whole.

:class:`GradPipeline` keeps the link busy without a thread of its own: a piece's inter-node
allreduce is *started* (``MPI_Iallreduce``, on a duplicate of the inter-node communicator)
as soon as its first phase ends, and the blocking intra-node calls of the next pieces drive
it on (a process inside any MPI call progresses every pending request), until the piece's
last phase waits for it, ``depth`` pieces later. A thread per rank for the link measured
slower on shared cores (every hand-off waits for the scheduler; docs/benchmarks.md).

Every rank makes the same calls in the same order, whatever the timing, so they match:
``first(0) ... first(D) last(0) first(D+1) last(1) ...`` then the remaining ``last`` in
order (:meth:`GradPipeline.drain`); each ``first`` starts its piece's allreduce, each
``last`` waits for it under the deadline. The mean is divided on one rank before the
allgather (or broadcast), then copied: every learner ends with the same bits, as on the
serial path.

Device tensors (of an MPI type) take it too (issue 44 item 4's GPU route):

- with NCCL inside the node, the node's phases run on NCCL (reduce-scatter, allgather) on
  the device, and only the shard crosses to a page-locked host buffer for the started
  allreduce (or goes as it is to a CUDA-aware MPI); the mean comes back to the device on
  the caller's stream before the allgather, which NCCL orders after it;
- where the node's ranks share a GPU (no NCCL), the piece is copied to a page-locked buffer
  once and runs the host route there, then is copied back.

Where the node's phases are not MPI's (NCCL on the device route, gloo), no MPI call runs
between a piece's start and its wait, and a started allreduce would advance only there: the
serial route plus copies (issue 59 item 4). So the pipeline tests its pieces in flight
around every phase of the node (``MPI_Test``, which progresses every pending request):
cheap where MPI's own node phases progress them anyway, and what moves the link where they
are not. :attr:`GradPipeline.early` counts the pieces whose allreduce had ended before its
wait.

A page-locked buffer is written again only after the copy that last read it (an event per
slot of buffers). The copies run on the calling thread's current stream: the reduction
thread's while backward runs, the training thread's when :meth:`GradPipeline.drain` ends
the step.
"""

from __future__ import annotations

from typing import Any

import torch

from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.direct import mpi_consts
from hadpsgd.comm.flat import zeros
from hadpsgd.comm.hierarchical import Reducer
from hadpsgd.comm.mpi import MPI_NATIVE
from hadpsgd.comm.staging import wait_device

DEFAULT_DEPTH = 2
"""Pieces whose allreduce is in flight before the oldest one's last phase waits for it."""


class _Piece:
    """One piece in flight: the tensor, its buffers and its allreduce's request."""

    __slots__ = ("back", "count", "mine", "padded", "request", "slot", "t", "wire")

    def __init__(self, t: torch.Tensor, padded: torch.Tensor | None, mine: torch.Tensor | None,
                 count: int, request: Any, wire: torch.Tensor | None = None,
                 back: torch.Tensor | None = None, slot: int = 0) -> None:
        self.t = t
        self.padded = padded
        self.mine = mine
        self.count = count
        self.request = request
        self.wire = wire if wire is not None else mine
        """What MPI reduces: ``mine``, or its page-locked copy."""
        self.back = back
        """The device piece ``t`` mirrors, copied back at the end (ranks sharing a GPU)."""
        self.slot = slot


class GradPipeline:
    """Means of host tensors over the world, the nodes' phases overlapped with the link's.

    Use :meth:`applies`, then :meth:`mean_` for each tensor of a step (several tensors share
    one pipeline) and :meth:`drain` before reading any of them, all on one thread at a time
    (the reduction's). Needs a hierarchical world (several nodes, some with several
    learners).

    Args:
        reducer: The topology's reducer (its intra-node backend, form and node layout).
        inter: A duplicate of the inter-node communicator, used only by the pipeline.
        watchdog: The deadline keeper of its waits.
        piece_bytes: Pieces are at most this large: a piece's allreduce overlaps the next
            pieces' intra-node phases.
        depth: Pieces in flight before the oldest one's last phase waits for its allreduce.
    """

    def __init__(self, reducer: Reducer, inter: Any, watchdog: Watchdog, piece_bytes: int,
                 depth: int = DEFAULT_DEPTH) -> None:
        if piece_bytes < 8 or depth < 1:
            raise ValueError(f"piece_bytes must be >= 8 and depth >= 1, got {piece_bytes}, "
                             f"{depth}")
        self.reducer = reducer
        self.inter = inter
        self.watchdog = watchdog
        self.piece_bytes = piece_bytes
        self.depth = depth
        self._open: list[_Piece] = []  # first phase done, last phase not yet run
        # depth + 2 sets of scratch: no buffer of a piece in flight is handed out again.
        self._scratch: list[dict[tuple[torch.dtype, int, str], torch.Tensor]] = [
            {} for _ in range(depth + 2)]
        self._read: list[Any] = [None] * (depth + 2)  # per slot: the last copy out of it
        self._slot = 0
        self.pieces = 0
        """Pieces averaged so far (for tests and benchmarks)."""
        self.early = 0
        """Pieces whose inter-node allreduce had ended before their last phase waited."""
        self.progress = True
        """Test the pieces in flight around every node phase (see the module docstring);
        off only to measure what it buys (benchmarks/comm/pipeline_progress.py)."""

    def applies(self, t: torch.Tensor) -> bool:
        """Whether ``t`` takes the pipeline: a contiguous tensor of an MPI type."""
        # (Where super-learners share a host the pieces' inter-node leg is still MPI's: the
        # host link is agreed per inter-node communicator, and every rank of a node must cut
        # its pieces alike, so the link cannot decide whether a tensor is piped.)
        return (self.reducer.hierarchical and t.dtype in MPI_NATIVE
                and t.is_contiguous() and not t.requires_grad)

    def _device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` takes the device route (a seam: the CPU tests say yes for host ones)."""
        return t.is_cuda

    def mean_(self, t: torch.Tensor, count: int) -> None:
        """Start averaging the 1-D ``t`` over ``count`` learners (the world).

        It holds the mean after :meth:`drain`; until then it must not be read or written.
        """
        n, step = t.numel(), max(1, self.piece_bytes // t.element_size())
        for lo in range(0, n, step):
            self._first(t[lo:lo + step], count)

    def drain(self) -> None:
        """Finish every piece started: afterwards each tensor holds its mean.

        Raises:
            CommTimeoutError: A piece's allreduce did not end within the deadline.
        """
        while self._open:
            self._last(self._open.pop(0))

    def _first(self, t: torch.Tensor, count: int) -> None:
        """A piece's first intra-node phase; then start its allreduce across the nodes."""
        red = self.reducer
        device = self._device(t)
        back = None
        if device and red.device_intra is None:
            # Ranks that share a GPU: the piece once through page-locked memory, the host
            # route on that copy, and back at the end (_last).
            back, t = t, self._pinned(t.dtype, t.numel(), 2)
            _to_host(t, back)
            device = False
        intra = red.device_intra if device else red.intra
        assert intra is not None
        self._progress()
        if red.algo == "shard":
            ls = red.local_size
            shard = -(-t.numel() // ls)
            padded = t
            if shard * ls != t.numel():
                padded = self._buffer(t.dtype, shard * ls, 0, t.device)
                padded[:t.numel()].copy_(t)
                padded[t.numel():].zero_()
            mine: torch.Tensor | None = self._buffer(t.dtype, shard, 1, t.device)
            intra.reduce_scatter_(padded, mine)
        else:
            padded = None
            intra.reduce_(t, root=0)
            mine = t if intra.rank == 0 else None
        request, wire = None, mine
        if mine is not None and red.num_nodes > 1:
            in_place, op_sum = mpi_consts()
            if device and red.cuda_aware:
                wait_device(mine.device)  # MPI reads device memory outside the streams
                request = self.inter.Iallreduce(in_place, mine, op_sum)
            else:
                if device:  # the shard alone crosses to the host for the link
                    wire = self._pinned(mine.dtype, mine.numel(), 3)
                    _to_host(wire, mine)
                request = self.inter.Iallreduce(in_place, wire.numpy(), op_sum)
        self._progress()  # the pieces before this one moved while its node phase ran
        self._open.append(_Piece(t, padded, mine, count, request, wire, back, self._slot))
        self._slot = (self._slot + 1) % len(self._scratch)
        if len(self._open) > self.depth:
            self._last(self._open.pop(0))

    def _last(self, piece: _Piece) -> None:
        """Wait for a piece's allreduce, then its last intra-node phase."""
        red = self.reducer
        mine = piece.mine
        if piece.request is not None and piece.request.Test():  # (a wait's first poll)
            piece.request = None
        if mine is not None and red.num_nodes > 1 and piece.request is None:
            self.early += 1  # ended by the time its last phase began
        self._progress()
        if piece.request is not None:
            self.watchdog.wait(piece.request,
                               f"inter-node allreduce of {mine.numel()} {mine.dtype} "  # type: ignore[union-attr]
                               "(gradient pipeline)", red.inter_ranks)
        wire = piece.wire
        if wire is not None and piece.count > 1:
            wire.div_(piece.count)  # on one rank per shard, then copied: the same bits
        device = piece.back is None and self._device(piece.t)
        intra = red.device_intra if device else red.intra
        assert intra is not None
        if wire is not None and wire is not mine:
            mine.copy_(wire, non_blocking=True)  # type: ignore[union-attr] - set with wire
            self._copied_out(piece.slot)  # NCCL's allgather is ordered after it
        if red.algo == "shard":
            assert piece.padded is not None and mine is not None
            intra.allgather_(mine, piece.padded)
            if piece.padded.data_ptr() != piece.t.data_ptr():
                piece.t.copy_(piece.padded[:piece.t.numel()])
        elif red.local_size > 1:
            intra.bcast_(piece.t, root=0)
        if piece.back is not None:
            piece.back.copy_(piece.t, non_blocking=True)
            self._copied_out(piece.slot)
        self.pieces += 1

    def _progress(self) -> None:
        """Test every piece's allreduce in flight (``MPI_Test`` progresses all of them).

        A request that has ended is dropped from its piece: its last phase need not wait.
        """
        if not self.progress:
            return
        for piece in self._open:
            if piece.request is not None and piece.request.Test():
                piece.request = None

    def _buffer(self, dtype: torch.dtype, numel: int, kind: int,
                device: torch.device | None = None) -> torch.Tensor:
        """Scratch of the current slot (a piece's padded copy or its shard) on ``device``."""
        device = device or torch.device("cpu")
        store = self._scratch[self._slot]
        key = (dtype, kind, str(device))
        buf = store.get(key)
        if buf is None or buf.numel() < numel:
            buf = zeros(numel, dtype, device)
            store[key] = buf
        return buf[:numel]

    def _pinned(self, dtype: torch.dtype, numel: int, kind: int) -> torch.Tensor:
        """A page-locked buffer of the current slot, once no copy still reads it."""
        read = self._read[self._slot]
        if read is not None:
            read.synchronize()  # the copy out of it, queued on a stream, has run
            self._read[self._slot] = None
        store = self._scratch[self._slot]
        key = (dtype, kind, "pinned")
        buf = store.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
            store[key] = buf
        return buf[:numel]

    def _copied_out(self, slot: int) -> None:
        """Remember the copy just queued out of ``slot``'s page-locked buffers."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event(blocking=True)
            event.record()
            self._read[slot] = event

    def close(self) -> None:
        """Drop what is in flight (after an error; a step ends with :meth:`drain`)."""
        self._open.clear()


def _to_host(host: torch.Tensor, t: torch.Tensor) -> None:
    """Copy ``t`` into the page-locked ``host``; the host sleeps until it has arrived.

    The copy runs on the current stream, behind what it holds (the piece's gradients, the
    node's reduction).
    """
    host.copy_(t, non_blocking=t.is_cuda)
    if t.is_cuda:
        wait_device(t.device)


__all__ = ["DEFAULT_DEPTH", "GradPipeline"]
