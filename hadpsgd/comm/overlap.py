"""Gradient buckets reduced while backward still runs (the overlap DDP gets from its reducer).

The gradients live in one flat buffer per dtype (:class:`hadpsgd.comm.FlatBuffer`). A
:class:`BucketPlan` cuts each buffer into contiguous buckets of about ``bucket_bytes``, in
*reverse* parameter order: backward produces the last layers' gradients first, so bucket 0
is complete first. A :class:`BucketReducer` reduces the buckets one by one as the caller
marks their parameters ready (from ``post_accumulate_grad`` hooks), in a background thread
with its own blocking MPI calls, so the reduction of one bucket runs while autograd computes
the next.

Why a thread and not non-blocking MPI: an ``MPI_Iallreduce`` on the shared-memory or TCP
transports progresses only while the process is inside MPI, and during backward it is not;
a blocking call in a second thread progresses by itself (mpi4py releases the GIL in it) and
keeps MPI's tuned algorithms. It needs ``MPI_THREAD_MULTIPLE``; without it the buckets are
reduced at the end of backward, in the same order, on the calling thread.

Every rank reduces the buckets in index order, whatever order its hooks fire in, so the
collectives match across ranks; each call keeps the watchdog's deadline (a stuck peer aborts
the job with a named error, as for every blocking call).

On a GPU the background thread issues its reductions on a stream of their own, which waits
only for an event recorded where each bucket became ready (:class:`~hadpsgd.comm.streams.
ReadyEvents`): NCCL and the copies of an MPI leg never wait for backward's later kernels,
backward never waits for a reduction, and the thread's host waits (before MPI reads a
buffer) are on that stream's events only. :meth:`BucketReducer.finish` makes the compute
stream wait for it once, before the optimizer reads the gradients.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hadpsgd.comm.deadline import CommTimeoutError
from hadpsgd.comm.streams import ReadyEvents, bind_thread

GradScope = str | None
"""Which learners a step's gradients are averaged over: ``world``, ``node`` or None (none);
not :data:`hadpsgd.comm.hierarchical.ReduceScope`, which is what one sum spans."""


@dataclass(frozen=True)
class Bucket:
    """A contiguous slice ``[lo, hi)`` of the flat buffer of ``dtype`` and its parameters."""

    dtype: torch.dtype
    lo: int
    hi: int
    params: tuple[int, ...]
    """Indices of the parameters (in the flat buffer's order) whose gradients it holds."""


class BucketPlan:
    """Buckets of about ``bucket_bytes`` over a flat gradient layout, last parameters first.

    Args:
        layout: For every parameter in flat-buffer order, ``(dtype, offset, numel)``: where
            its gradient sits in the buffer of its dtype.
        bucket_bytes: Target bucket size; a parameter larger than it is a bucket of its own.
    """

    def __init__(self, layout: Sequence[tuple[torch.dtype, int, int]], bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.buckets: list[Bucket] = []
        open_: dict[torch.dtype, list[int]] = {}  # dtype -> params of its unfinished bucket
        filled: dict[torch.dtype, int] = {}  # dtype -> elements in that bucket

        def close(dtype: torch.dtype) -> None:
            members = open_.pop(dtype, [])
            filled.pop(dtype, None)
            if members:
                lo = min(layout[i][1] for i in members)
                hi = max(layout[i][1] + layout[i][2] for i in members)
                self.buckets.append(Bucket(dtype, lo, hi, tuple(sorted(members))))

        size = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype, _, _ in layout}
        for i in reversed(range(len(layout))):
            dtype, _, numel = layout[i]
            members = open_.setdefault(dtype, [])
            members.append(i)
            filled[dtype] = filled.get(dtype, 0) + numel
            if filled[dtype] * size[dtype] >= bucket_bytes:
                close(dtype)
        for dtype in list(open_):
            close(dtype)
        self.of_param = [0] * len(layout)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.params:
                self.of_param[i] = b

    def __len__(self) -> int:
        return len(self.buckets)


class BucketReducer:
    """Averages a flat gradient layout bucket by bucket, overlapped with backward.

    Per step: :meth:`param_ready` for each parameter whose gradient is complete (from a
    hook; any thread), then :meth:`finish` after backward, which marks whatever did not fire
    as ready, waits for every bucket and returns each bucket's *local* sum (taken before its
    reduction, for naming the rank a non-finite gradient came from).

    Args:
        plan: The buckets.
        buffers: The flat gradient buffer of each dtype.
        reduce: ``reduce(view, scope)`` averages one bucket in place over ``scope``.
        scope: Called once per step, when its first bucket is reduced: the step's scope
            (None: nothing to reduce, :meth:`finish` returns no sums).
        local_sum: The sum of a bucket taken before its reduction (a device tensor).
        background: Reduce in a background thread (needs MPI_THREAD_MULTIPLE).
        timeout: Backstop deadline of :meth:`finish`, past the calls' own deadlines.
    """

    def __init__(self, plan: BucketPlan, buffers: dict[torch.dtype, torch.Tensor],
                 reduce: Callable[[torch.Tensor, str], None], scope: Callable[[], GradScope],
                 local_sum: Callable[[torch.Tensor], torch.Tensor], background: bool,
                 timeout: float) -> None:
        self.plan = plan
        self.views = [buffers[b.dtype][b.lo:b.hi] for b in plan.buckets]
        self._reduce = reduce
        self._local_sum = local_sum
        self._scope_of_step = scope
        self.timeout = timeout
        self._cond = threading.Condition()
        self._pending = [len(b.params) for b in plan.buckets]  # parameters not yet ready
        self._seen: set[int] = set()  # parameters ready this step
        self._ready = [False] * len(plan)
        self._next = 0  # the next bucket to reduce (index order on every rank)
        self._scope: GradScope = None
        self._local: list[torch.Tensor | None] = [None] * len(plan)
        self._error: BaseException | None = None
        self._stopped = False
        self.overlapped = 0
        """Buckets of the last step whose reduction began before :meth:`finish` was called,
        i.e. while backward still ran (overlapped)."""
        self._began = 0
        self._thread: threading.Thread | None = None
        device = next((v.device for v in self.views if v.is_cuda), None)
        # Only a background thread needs them: reduced on the calling thread after backward,
        # a bucket's reduction is simply queued on the compute stream.
        self._events = (ReadyEvents(device, len(plan))
                        if background and len(plan) and device is not None else None)
        if background and len(plan):
            self._thread = threading.Thread(target=self._serve, name="hadpsgd-grad-reduce",
                                            daemon=True)
            self._thread.start()

    @property
    def background(self) -> bool:
        """Whether a background thread reduces the buckets."""
        return self._thread is not None

    # ------------------------------------------------------------------ producer side
    def param_ready(self, index: int) -> None:
        """The gradient of parameter ``index`` is complete for this step.

        Raises:
            RuntimeError: For a second gradient of the same parameter before the step ends
                (a second backward pass): its bucket's mean may have started without it, so
                each learner would add its own part after the mean, and the replicas part.
        """
        b = self.plan.of_param[index]
        with self._cond:
            if index in self._seen:
                raise RuntimeError(
                    "a second backward pass before the step: with the overlapped gradient "
                    "reduction each bucket's mean starts as its gradients land, so this "
                    "pass's gradients would miss it. Accumulate micro-batches inside `with "
                    "dist.no_sync():` (the last backward outside it), or step after every "
                    "backward")
            self._seen.add(index)
            self._pending[b] -= 1
            complete = self._pending[b] == 0
            if self._events is not None:  # on the stream this gradient was accumulated on
                self._events.mark(b, complete)
            if complete:
                self._ready[b] = True
                if b == self._next:
                    self._cond.notify_all()

    def finish(self) -> list[torch.Tensor]:
        """Reduce what is left, wait for every bucket and start the next step afresh.

        Returns:
            Each reduced bucket's local sum before the reduction (empty when the step's
            scope was None).

        Raises:
            CommTimeoutError: A reduction failed or (backstop) did not end in time.
        """
        with self._cond:
            self.overlapped = self._began if self._thread is not None else 0
            if self._events is not None:
                # The rest is ready as of this thread's stream now: backward has made it wait
                # for every stream backward ran on, and the gradients gathered since are on it.
                for b, ready in enumerate(self._ready):
                    if not ready:
                        self._events.mark(b, complete=True)
            self._ready = [True] * len(self.plan)
            self._cond.notify_all()
        if self._thread is None:
            while self._next < len(self.plan):
                self._reduce_next()
        else:
            deadline = time.monotonic() + self.timeout
            with self._cond:
                while self._next < len(self.plan) and self._error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommTimeoutError(
                            f"gradient bucket {self._next} of {len(self.plan)} was not reduced "
                            f"within {self.timeout:g} s (HADPSGD_TIMEOUT)")
                    self._cond.wait(min(left, 1.0))
        if self._error is not None:
            err, self._error = self._error, None
            self._stopped = True
            if isinstance(err, CommTimeoutError):
                raise err
            raise RuntimeError(f"gradient reduction failed: {err}") from err
        sums = [s for s in self._local if s is not None]
        if self._events is not None:
            self._events.join(sums)  # the optimizer's stream waits for the reductions once
        with self._cond:
            self._pending = [len(b.params) for b in self.plan.buckets]
            self._seen.clear()
            self._ready = [False] * len(self.plan)
            self._local = [None] * len(self.plan)
            self._scope = None
            self._next = self._began = 0
            if self._events is not None:
                self._events.reset()
        return sums

    # ------------------------------------------------------------------ reducing side
    def _reduce_next(self) -> None:
        b = self._next
        self._began = b + 1
        if b == 0:
            self._scope = self._scope_of_step()
        if self._scope is not None:
            if self._events is None:
                self._reduce_bucket(b)
            else:
                self._events.wait(b)  # the comm stream waits for this bucket's gradients only
                with self._events.issuing():
                    self._reduce_bucket(b)
        with self._cond:
            self._next = b + 1
            self._cond.notify_all()

    def _reduce_bucket(self, b: int) -> None:
        view = self.views[b]
        self._local[b] = self._local_sum(view)
        self._reduce(view, self._scope)  # type: ignore[arg-type] - not None here

    def _serve(self) -> None:
        bind_thread(next((v.device for v in self.views if v.is_cuda), None))
        while True:
            with self._cond:
                while not self._stopped and not (self._next < len(self.plan)
                                                 and self._ready[self._next]):
                    self._cond.wait()
                if self._stopped:
                    return
            try:
                self._reduce_next()
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                with self._cond:
                    self._error = err
                    self._stopped = True
                    self._cond.notify_all()
                return

    def close(self) -> None:
        """Stop the background thread (it is idle between steps)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


__all__ = ["Bucket", "BucketPlan", "BucketReducer", "GradScope"]
