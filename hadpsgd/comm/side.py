"""A private cross-node channel and a thread that reduces on it while training goes on.

BMUF's overlapped block sync (``--bmuf-overlap``) averages a block's models across the nodes
while the next block computes. The main thread keeps making its own collectives meanwhile
(the super-learner's gradient average inside the node, the loop's control points over the
world), so the background reduction must not share a communicator, nor a watchdog slot, with
them: :class:`SideChannel` holds its own duplicate of the inter-node communicator (local rank
``j`` of every node) and its own :class:`~hadpsgd.comm.deadline.Watchdog`, as the gossip
thread's :class:`~hadpsgd.comm.pair.PairChannel` does.

Inside a node every learner holds the same tensor (a super-learner is synchronous). With one
learner per node (the BMUF-Adam paper's layout) the mean is one non-blocking MPI allreduce
(fp32) or a :class:`~hadpsgd.comm.compressed.CompressedMean`. With several, local rank ``j``
carries the ``j``-th slice across the nodes and the node gathers the slices over its own
duplicate of the node's communicator (a compressed mean over both duplicates, whatever the
wire), so each byte crosses a node's link once. Every learner ends with the same bits.

Jobs run in submission order, one at a time, so the collectives match across ranks. Without
``MPI_THREAD_MULTIPLE`` a job runs when its result is first waited for, on the caller's
thread: the same calls in the same order, the same values, no overlap.

On a GPU a job that names its device tensors (``submit(..., uses=...)``) runs on a stream of
the channel's own, behind an event recorded on the submitter's stream at submission (after
the block's last step and the packing of what is sent), never on the compute stream: its
copies, its coding kernels and the host's waits for them leave training alone. An fp32 mean
of a device tensor goes through one page-locked host buffer, allocated once and reused
(one copy off the device, a sleeping wait for it, MPI, one copy back), not through pageable
memory. :meth:`SideChannel.wait` makes the waiter's stream wait for the job's last copy.

Where the super-learners (of one learner each) share a host, each on its own GPU, an fp32
mean of a device tensor takes the channel's own NCCL groups instead (a twin of the
topology's :class:`~hadpsgd.comm.hostlink.HostLink`, waited on by this channel's watchdog):
NCCL among the host's members, MPI between hosts (through the page-locked buffer).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hadpsgd.comm.codec import check_wire, payload_bytes
from hadpsgd.comm.compressed import CompressedMean
from hadpsgd.comm.deadline import CommTimeoutError, Watchdog
from hadpsgd.comm.hostlink import HostLink
from hadpsgd.comm.mpi import MPI_NATIVE, mpi
from hadpsgd.comm.staging import Stager, host_dtype
from hadpsgd.comm.streams import bind_thread


class Job:
    """One submitted reduction; :meth:`SideChannel.wait` gives its outcome.

    Args:
        fn: The reduction (it makes the channel's calls).
        what: What it is, for errors.
        stream: The CUDA stream it runs on (None: the running thread's current one).
        uses: The device tensors it reads and writes (with ``stream``).
    """

    __slots__ = ("done", "error", "finished", "fn", "ready", "stream", "uses", "what")

    def __init__(self, fn: Callable[[], None], what: str, stream: Any = None,
                 uses: Sequence[torch.Tensor] = ()) -> None:
        self.fn = fn
        self.what = what
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.stream = stream
        self.uses = tuple(uses)
        self.ready: Any = None
        self.finished: Any = None
        if stream is not None:
            # The inputs as the submitter's stream has written them so far: the job's stream
            # waits for this, not for whatever that stream queues next.
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(stream.device))
            self.finished = torch.cuda.Event()

    def run(self) -> None:
        """Run the job once, keeping its error for the waiter."""
        try:
            if self.stream is None:
                self.fn()
            else:
                # This runs in the channel's thread: bound to the job's GPU, leaving the
                # stream's context below does not switch it to GPU 0 (bind_thread).
                bind_thread(self.stream.device)
                self.stream.wait_event(self.ready)
                with torch.cuda.stream(self.stream):
                    self.fn()
                self.finished.record(self.stream)
                for t in self.uses:  # not reused by the allocator before this stream is done
                    t.record_stream(self.stream)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            self.error = err
        finally:
            self.done.set()

    def arrived(self) -> None:
        """The calling thread's current stream waits for the job's device work (not the host)."""
        if self.finished is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.finished)


class SideChannel:
    """Cross-node means on a private communicator, in a background thread when MPI allows.

    Args:
        inter: A duplicate of the inter-node communicator (ranks = node indices).
        watchdog: A watchdog of its own (its own control communicator).
        inter_ranks: World ranks in ``inter``, by node (to name a missing one).
        wire: ``fp32`` (as is), ``bf16`` or ``int8`` (with error feedback).
        background: Run jobs in a background thread (needs MPI_THREAD_MULTIPLE).
        intra: A duplicate of the node's communicator when a node has several learners
            (each then carries a slice across the nodes).
        node_ranks: World ranks in ``intra``, by local rank.
        link: The channel's own host link (fp32 means of the tensors it takes), or None;
            the topology that made it releases it.
    """

    def __init__(self, inter: Any, watchdog: Watchdog, inter_ranks: list[int], wire: str,
                 background: bool, intra: Any = None,
                 node_ranks: list[int] | None = None, link: HostLink | None = None) -> None:
        check_wire(wire)
        self.inter = inter
        self.watchdog = watchdog
        self.inter_ranks = inter_ranks
        self.intra = intra
        self.node_ranks = node_ranks
        self.link = link
        self.num_nodes = inter.Get_size()
        self.wire = wire
        self.bytes_sent = 0
        """Payload bytes this rank sent to other nodes (fp32: a ring allreduce's share)."""
        self._compressors: dict[str, CompressedMean] = {}
        self._stager = Stager()  # the page-locked host buffer of fp32 means of device tensors
        self._streams: dict[torch.device, Any] = {}  # jobs' stream, per device
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._serve, name="hadpsgd-side-reduce",
                                            daemon=True)
            self._thread.start()

    @property
    def background(self) -> bool:
        """Whether jobs run in a background thread."""
        return self._thread is not None

    # ------------------------------------------------------------------ reductions
    def mean_(self, key: str, t: torch.Tensor, feedback: bool = True) -> torch.Tensor:
        """Average ``t`` (identical on the learners of each node) across nodes, in place.

        Args:
            key: Names the tensor across calls: a compressed wire keeps its rounding error
                per key and adds it to the next call's tensor of that key (error feedback).
            t: A contiguous tensor.
            feedback: Keep that rounding error (read at a key's first call). False: each
                mean of the key stands alone, for a caller that corrects the error itself
                (ADPSGD's evaluation average, sent as a difference to the last one).

        Returns:
            ``t``, holding the mean; bit-identical on every learner.
        """
        if self.num_nodes == 1:
            return t
        if self.wire != "fp32" or self.intra is not None:
            comp = self._compressor(key, t, feedback)
            before = comp.bytes_sent
            comp.mean_(t)
            self.bytes_sent += comp.bytes_sent - before
            return t
        what = f"background inter-node mean of {t.numel()} {t.dtype}"
        if self.link is not None and self.link.takes(t) and (t.is_cuda
                                                             or t.dtype in MPI_NATIVE):
            work = t if t.is_contiguous() else t.contiguous()
            self.link.allreduce_(work.view(-1), what, self._leaders_sum_)
            work.div_(self.num_nodes)
            if work is not t:
                t.copy_(work)
        elif t.is_cuda:
            # One page-locked copy of the whole tensor on the current stream (a job's own):
            # one MPI message, as on the host.
            work = t if t.is_contiguous() else t.contiguous()
            self._stager.run_whole(work.view(-1), lambda flat: self._host_mean_(flat, what))
            if work is not t:
                t.copy_(work)
        else:
            host = t if t.dtype in MPI_NATIVE else t.to("cpu", host_dtype(t.dtype))
            self._host_mean_(host.reshape(-1), what)
            if host is not t:
                t.copy_(host)
        n = self.num_nodes
        self.bytes_sent += 2 * (n - 1) * payload_bytes(t.numel(), "fp32", t.element_size()) // n
        return t

    def _host_mean_(self, flat: torch.Tensor, what: str) -> None:
        """The mean of the 1-D host tensor ``flat`` across nodes, in place (``what``: errors)."""
        self._host_sum_(self.inter, flat, what, self.inter_ranks)
        flat.div_(self.num_nodes)

    def _host_sum_(self, comm: Any, flat: torch.Tensor, what: str, group: list[int]) -> None:
        """The sum of the 1-D host tensor ``flat`` over ``comm``, in place."""
        MPI = mpi()  # noqa: N806 - the module is conventionally MPI
        if self.background:
            # Non-blocking, polled with short sleeps: a blocking call would spin a core for
            # as long as the link takes, and that core is the one training needs.
            request = comm.Iallreduce(MPI.IN_PLACE, flat.numpy(), MPI.SUM)
            self.watchdog.wait(request, what, group)
        else:
            with self.watchdog.guard(what, group):
                comm.Allreduce(MPI.IN_PLACE, flat.numpy(), MPI.SUM)

    def _leaders_sum_(self, comm: Any, t: torch.Tensor, what: str,
                      group: list[int] | None) -> None:
        """The host leaders' MPI leg of a link's sum (a device tensor through the buffer)."""
        members = group or []
        if t.is_cuda:
            self._stager.run_whole(t, lambda flat: self._host_sum_(comm, flat, what, members))
        else:
            self._host_sum_(comm, t, what, members)

    def state_dict(self) -> dict[str, Any]:
        """The compressed wire's rounding errors (per key), for an exact resume."""
        return {key: comp.state_dict() for key, comp in self._compressors.items()}

    def load_state_dict(self, state: dict[str, Any], like: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; ``like`` gives each key's tensor (size, dtype, device)."""
        for key, saved in state.items():
            self._compressor(key, like[key]).load_state_dict(saved)

    def move_residual_(self, key: str, into: torch.Tensor, keep: float = 1.0) -> None:
        """Add ``keep`` of ``key``'s worker rounding error to ``into``; that part leaves it.

        Nothing where ``key`` has no compressed mean (fp32, one node, never sent) or no error
        feedback. Call it between means (after the job that ran it was waited for).
        """
        comp = self._compressors.get(key)
        if comp is not None:
            comp.move_worker_residual_(into, keep)

    def _compressor(self, key: str, t: torch.Tensor, feedback: bool = True) -> CompressedMean:
        """The compressed mean of ``key`` (made on first use; it keeps that key's residuals)."""
        comp = self._compressors.get(key)
        if comp is None:
            comp = self._compressors[key] = CompressedMean(
                self.inter, self.watchdog, self.inter_ranks, t.numel(), t.dtype, t.device,
                self.wire, intra=self.intra, node_ranks=self.node_ranks,
                polled=self.background, feedback=feedback)
        return comp

    # ------------------------------------------------------------------ jobs
    def submit(self, fn: Callable[[], None], what: str,
               uses: Sequence[torch.Tensor] = ()) -> Job:
        """Queue ``fn`` (it makes this channel's calls); it runs after every earlier job.

        Args:
            fn: The job.
            what: What it is, for errors.
            uses: The tensors it reads and writes. If any is on a GPU, the job runs on this
                channel's stream of that device, behind what the calling thread's stream
                has queued so far (and nothing it queues later), and :meth:`wait` orders
                the waiter's stream after it.
        """
        device = next((t.device for t in uses if t.is_cuda), None)
        stream = None
        if device is not None:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
        job = Job(fn, what, stream, [t for t in uses if t.is_cuda])
        if self._thread is not None:
            self._queue.put(job)
        return job

    def wait(self, job: Job) -> None:
        """Wait for ``job`` (running it here without a background thread).

        Raises:
            CommTimeoutError: The job's reduction failed or (backstop) did not end in time;
                its own calls are under this channel's deadline, which aborts the job first.
        """
        if self._thread is None and not job.done.is_set():
            job.run()
        if not job.done.wait(2 * self.watchdog.timeout + 5.0):
            raise CommTimeoutError(f"{job.what} did not complete within "
                                   f"{self.watchdog.timeout:g} s (HADPSGD_TIMEOUT)")
        if job.error is not None:
            err, job.error = job.error, None
            if isinstance(err, CommTimeoutError):
                raise err
            raise RuntimeError(f"{job.what} failed: {err}") from err
        job.arrived()  # the waiter's stream reads the job's results next

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            job.run()

    def close(self) -> None:
        """Stop the thread once the queued jobs are done, and this channel's watchdog."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self.watchdog.timeout + 5.0)
            self._thread = None
        self.watchdog.stop()


__all__ = ["Job", "SideChannel"]
