"""Copies of a live device tensor to and from pinned host memory, beside the compute stream.

ADPSGD's gossip thread snapshots the parameters (172 MB for ``swb``) while the main thread
trains on them, and hands back a delta of the same size. Done as plain copies, both ran on
the device's default stream, the compute stream: the snapshot waited for every kernel
queued before it, and the main thread's optimizer step waited (on the lock) for the copy;
the delta's copy onto the device blocked the main thread.

:class:`CopyStream` puts those copies on a stream of their own, ordered by events only:

- the writer (the main thread) wraps each write of the tensor in :meth:`CopyStream.writing`:
  its stream first waits for a snapshot still reading the tensor, and afterwards records
  the event the next snapshot waits for;
- :meth:`CopyStream.fetch` queues the snapshot on the copy stream behind that event (the
  weights after the last step, not a torn mix), and :meth:`CopyStream.wait` puts the host
  to sleep until it is done, only where the data are read;
- :meth:`CopyStream.upload` queues a host buffer's copy onto the device, and
  :meth:`CopyStream.arrived` makes the reader's stream wait for it; the host never does.

The writer and the snapshot's caller must hold one lock around :meth:`writing` blocks and
:meth:`fetch` (the gossip lock), so that each snapshot is ordered against each write. Host
buffers come from :meth:`CopyStream.host`: page-locked, allocated once by their owner and
reused, since only page-locked memory is copied without blocking. On the CPU every method
is the plain copy or nothing, so host training is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class CopyStream:
    """A copy stream between one device's tensors and pinned host buffers, with its events.

    Args:
        device: Where the device tensors live. On the CPU nothing is asynchronous.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if not self.cuda:
            return
        self.stream = torch.cuda.Stream(device=self.device)
        # Reusable events: ``wait_event`` takes the record current at the call, so a later
        # record never changes what an earlier wait waits for.
        self._written = torch.cuda.Event()  # the writer's latest write, on its stream
        self._read = torch.cuda.Event(blocking=True)  # the latest fetch (the host sleeps on it)
        self._put = torch.cuda.Event()  # the latest upload
        # The tensor as it is now: a fetch before any write waits for what made it.
        self._written.record(torch.cuda.current_stream(self.device))

    def host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new host buffer for copies of this device's tensors (page-locked on a GPU).

        Allocate it once and reuse it: page-locked memory is slow to get and scarce.
        """
        return torch.empty(numel, dtype=dtype,
                           pin_memory=self.cuda and torch.cuda.is_available())

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around a write of the fetched tensor, on the calling thread's current stream.

        Before the block, that stream waits for a fetch still reading the tensor; after it,
        the next fetch waits for what the block queued. Hold the fetching side's lock.
        """
        if not self.cuda:
            yield
            return
        torch.cuda.current_stream(self.device).wait_event(self._read)
        try:
            yield
        finally:  # also after a failed write: whatever it queued comes before the next fetch
            self._written.record(torch.cuda.current_stream(self.device))

    def fetch(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Queue the copy of device ``src`` into host ``out`` behind the latest write.

        ``out`` holds it once :meth:`wait` returns. Call it under the lock that the
        :meth:`writing` blocks are under. On the CPU the copy is made here.
        """
        if not self.cuda:
            out.copy_(src)
            return
        self.stream.wait_event(self._written)
        with torch.cuda.stream(self.stream):
            out.copy_(src, non_blocking=True)
        self._read.record(self.stream)
        if src.is_cuda:  # read on this stream: its memory is not reused before the copy ends
            src.record_stream(self.stream)

    def wait(self) -> None:
        """Sleep until the latest fetch (and every copy queued before it) has ended."""
        if self.cuda:
            self._read.synchronize()

    def upload(self, host: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Queue the copy of ``host`` into device ``dst`` on the copy stream; ``dst``.

        The reader calls :meth:`arrived` before it reads ``dst``. ``host`` must stay
        unchanged until the copy has run: a later :meth:`fetch`'s :meth:`wait` implies it
        (the same stream, in order). ``dst`` must not be read by an earlier reader still:
        its next write here comes after a fetch, behind the writer's latest
        :meth:`writing` block.
        """
        if not self.cuda:
            return dst.copy_(host)
        with torch.cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)
        self._put.record(self.stream)
        if dst.is_cuda:
            dst.record_stream(self.stream)
        return dst

    def arrived(self) -> None:
        """The calling thread's current stream waits for the latest upload (not the host)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._put)


__all__ = ["CopyStream"]
