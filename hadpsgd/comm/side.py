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
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from hadpsgd.comm.codec import check_wire, payload_bytes
from hadpsgd.comm.compressed import CompressedMean
from hadpsgd.comm.deadline import CommTimeoutError, Watchdog
from hadpsgd.comm.mpi import MPI_NATIVE, mpi


class Job:
    """One submitted reduction; :meth:`SideChannel.wait` gives its outcome."""

    __slots__ = ("done", "error", "fn", "what")

    def __init__(self, fn: Callable[[], None], what: str) -> None:
        self.fn = fn
        self.what = what
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        """Run the job once, keeping its error for the waiter."""
        try:
            self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            self.error = err
        finally:
            self.done.set()


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
    """

    def __init__(self, inter: Any, watchdog: Watchdog, inter_ranks: list[int], wire: str,
                 background: bool, intra: Any = None,
                 node_ranks: list[int] | None = None) -> None:
        check_wire(wire)
        self.inter = inter
        self.watchdog = watchdog
        self.inter_ranks = inter_ranks
        self.intra = intra
        self.node_ranks = node_ranks
        self.num_nodes = inter.Get_size()
        self.wire = wire
        self.bytes_sent = 0
        """Payload bytes this rank sent to other nodes (fp32: a ring allreduce's share)."""
        self._compressors: dict[str, CompressedMean] = {}
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
    def mean_(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """Average ``t`` (identical on the learners of each node) across nodes, in place.

        Args:
            key: Names the tensor across calls: a compressed wire keeps its rounding error
                per key and adds it to the next call's tensor of that key (error feedback).
            t: A contiguous tensor.

        Returns:
            ``t``, holding the mean; bit-identical on every learner.
        """
        if self.num_nodes == 1:
            return t
        if self.wire != "fp32" or self.intra is not None:
            comp = self._compressor(key, t)
            before = comp.bytes_sent
            comp.mean_(t)
            self.bytes_sent += comp.bytes_sent - before
            return t
        host = t if t.device.type == "cpu" and t.dtype in MPI_NATIVE else t.to(
            "cpu", torch.float32 if t.dtype not in MPI_NATIVE else t.dtype)
        flat = host.reshape(-1)
        MPI = mpi()  # noqa: N806 - the module is conventionally MPI
        what = f"background inter-node mean of {t.numel()} {t.dtype}"
        if self.background:
            # Non-blocking, polled with short sleeps: a blocking call would spin a core for
            # as long as the link takes, and that core is the one training needs.
            request = self.inter.Iallreduce(MPI.IN_PLACE, flat.numpy(), MPI.SUM)
            self.watchdog.wait(request, what, self.inter_ranks)
        else:
            with self.watchdog.guard(what, self.inter_ranks):
                self.inter.Allreduce(MPI.IN_PLACE, flat.numpy(), MPI.SUM)
        flat.div_(self.num_nodes)
        if host is not t:
            t.copy_(host)
        n = self.num_nodes
        self.bytes_sent += 2 * (n - 1) * payload_bytes(t.numel(), "fp32", t.element_size()) // n
        return t

    def state_dict(self) -> dict[str, Any]:
        """The compressed wire's rounding errors (per key), for an exact resume."""
        return {key: comp.state_dict() for key, comp in self._compressors.items()}

    def load_state_dict(self, state: dict[str, Any], like: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; ``like`` gives each key's tensor (size, dtype, device)."""
        for key, saved in state.items():
            self._compressor(key, like[key]).load_state_dict(saved)

    def _compressor(self, key: str, t: torch.Tensor) -> CompressedMean:
        """The compressed mean of ``key`` (made on first use; it keeps that key's residuals)."""
        comp = self._compressors.get(key)
        if comp is None:
            comp = self._compressors[key] = CompressedMean(
                self.inter, self.watchdog, self.inter_ranks, t.numel(), t.dtype, t.device,
                self.wire, intra=self.intra, node_ranks=self.node_ranks,
                polled=self.background)
        return comp

    # ------------------------------------------------------------------ jobs
    def submit(self, fn: Callable[[], None], what: str) -> Job:
        """Queue ``fn`` (it makes this channel's calls); it runs after every earlier job."""
        job = Job(fn, what)
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
