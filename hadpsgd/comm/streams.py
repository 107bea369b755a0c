"""The gradient reductions' own CUDA stream, and when each bucket may enter it (DDP's pattern).

A bucket's gradients are complete when backward's ``post_accumulate_grad`` hook has run for
each of its parameters. :class:`ReadyEvents` records an event there, on the stream backward
accumulated on, and the thread that reduces the bucket makes the reductions' stream wait for
that event only: not for the whole compute stream (whose later kernels are the next
buckets' backward), and without the host waiting. Everything the reduction queues (its
local sum, NCCL's reduce-scatter and all-gather, which wait for the stream they are called
from, the copies of an MPI leg) follows from there; the host of the reducing thread waits
only for events on that stream, before MPI reads a buffer. Before the optimizer reads the
gradients, the compute stream waits for the reductions' stream once (:meth:`join`).

Why the reducing thread needs its own stream: its current stream is otherwise the device's
default stream, the compute stream itself, so NCCL and every copy would wait for all of
backward queued so far, and the blocking waits of NCCL's work would make backward wait for
each bucket's reduction in turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


class ReadyEvents:
    """Per bucket, events on the streams its gradients were completed on; one comm stream.

    The usual case, one compute stream, costs one event record per bucket and step. Where a
    bucket's hooks ran on several streams (backward of a model spread over streams), an event
    is recorded on a stream when the next hook of the bucket comes on another one (everything
    the earlier hooks queued there precedes it), and on the last stream when the bucket is
    complete.

    Args:
        device: The CUDA device of the gradient buffers.
        buckets: Number of buckets.
    """

    def __init__(self, device: torch.device, buckets: int) -> None:
        self.device = device
        # High priority: the reductions' short kernels (a sum, a padding copy) need not
        # queue behind backward's long ones for the free SMs.
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        # Per bucket and producing stream (by handle): a reusable event. Recording an
        # event again is safe once the stream that waited for its last record was told to:
        # ``wait_event`` takes the record current at the call.
        self._events: list[dict[int, Any]] = [{} for _ in range(buckets)]
        self._last: list[Any] = [None] * buckets  # the stream of the bucket's latest hook
        self._marked: list[list[Any]] = [[] for _ in range(buckets)]  # events of this step

    def mark(self, bucket: int, complete: bool) -> None:
        """A hook of ``bucket`` ran on the calling thread's current stream.

        Called on the producer's thread (autograd's, or the main thread for the parameters
        whose hooks did not fire), after the gradient is in the bucket; ``complete`` when it
        was the bucket's last.
        """
        stream = torch.cuda.current_stream(self.device)
        last = self._last[bucket]
        if last is not None and last.cuda_stream != stream.cuda_stream:
            self._record(bucket, last)  # the earlier hooks' work on the other stream
        self._last[bucket] = stream
        if complete:
            self._record(bucket, stream)
            self._last[bucket] = None

    def _record(self, bucket: int, stream: Any) -> None:
        events = self._events[bucket]
        event = events.get(stream.cuda_stream)
        if event is None:
            event = events[stream.cuda_stream] = torch.cuda.Event()
        event.record(stream)
        if not any(e is event for e in self._marked[bucket]):
            self._marked[bucket].append(event)

    def wait(self, bucket: int) -> None:
        """The comm stream waits for ``bucket``'s gradients (no host wait)."""
        for event in self._marked[bucket]:
            self.stream.wait_event(event)
        self._marked[bucket] = []

    def reset(self) -> None:
        """Forget this step's marks (a step whose buckets were not all reduced)."""
        self._last = [None] * len(self._last)
        self._marked = [[] for _ in self._marked]

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        """Make the comm stream the calling thread's current stream for a ``with`` block."""
        with torch.cuda.stream(self.stream):
            yield

    def join(self, used: Sequence[torch.Tensor] = ()) -> None:
        """The calling thread's current stream waits for all the comm stream's work.

        Args:
            used: Tensors made on the comm stream that the current stream reads next (the
                buckets' local sums): the allocator must not hand their memory to the comm
                stream again before that reading is done.
        """
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for t in used:
            if t.is_cuda:
                t.record_stream(current)


def bind_thread(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device; nothing for a host device.

    Call it first in every thread that touches CUDA. A new thread's current device is 0,
    whatever the main thread set, and leaving a ``torch.cuda.stream(...)`` context (or
    anything that makes an event, a stream or a context without naming a device) there calls
    ``cudaSetDevice(0)``, which since CUDA 12 makes a primary context on GPU 0: ~0.5 GiB of
    GPU 0 for every rank of an 8-GPU node, and an error where GPUs run in
    ``EXCLUSIVE_PROCESS`` compute mode, as clusters set them.

    Args:
        device: The device the thread works on (the buffers' device), or None.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


__all__ = ["ReadyEvents", "bind_thread"]
