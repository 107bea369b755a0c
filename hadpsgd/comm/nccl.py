"""Intra-node NCCL through torch.distributed's own process group, bootstrapped over MPI.

Why torch.distributed and not CuPy's NCCL bindings: every CUDA build of torch ships NCCL, so
a GPU run needs no second package whose CUDA version must match (a missing or mismatched
CuPy was the silent fall-back to host staging); the process group orders its work with
torch's streams and caching allocator; and it shares :class:`TorchIntra` with the gloo
backend, so the CPU test suite runs the very calls NCCL receives.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from hadpsgd.comm.backends import STORE_TIMEOUT_CAP_S, TorchIntra
from hadpsgd.comm.deadline import Watchdog


def nccl_available() -> tuple[bool, str]:
    """Whether torch.distributed has NCCL here, and if not, why (one line for the log)."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return False, (f"this torch build ({torch.__version__}) has no NCCL; install a CUDA "
                       "build of torch")
    return True, "torch.distributed NCCL"


NCCL_GRACE_S = 120.0
"""Seconds NCCL's own watchdog waits past hadpsgd's deadline before it aborts the process.

torch's NCCL watchdog kills the process without naming anyone; hadpsgd's watchdog names the
missing peer and what it was doing. NCCL's deadline is therefore the later one, so that a
stuck peer is always reported by hadpsgd first."""


def nccl_timeout(deadline_s: float) -> datetime.timedelta:
    """NCCL's own timeout for hadpsgd's deadline ``deadline_s`` (see :data:`NCCL_GRACE_S`).

    ``HADPSGD_TIMEOUT=inf`` (no deadline) or one of up to 30 days would overflow a
    ``timedelta`` here: NCCL's is capped as the stores' is (``STORE_TIMEOUT_CAP_S``).
    """
    return datetime.timedelta(seconds=min(2 * deadline_s + NCCL_GRACE_S, 2 * STORE_TIMEOUT_CAP_S))


def _free_device_bytes(device: torch.device) -> int | None:
    """The GPU's free memory now (``cudaMemGetInfo``, every process's use counted), or None."""
    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except (RuntimeError, AssertionError, ValueError):  # no CUDA here: nothing to say
        return None


class NCCLIntra(TorchIntra):
    """NCCL collectives on device tensors among the GPUs of one node.

    Operations run on the process group's NCCL stream, which waits for the caller's current
    stream (so they see the gradients just computed). A blocking call then makes the current
    stream wait for it and blocks the host on a blocking-sync CUDA event under the watchdog's
    guard, so a stuck peer ends the job with a named error instead of a hang (and a failed
    wait aborts the communicator). A *deferred* allreduce (:meth:`allreduce_deferred_`,
    the gradient buckets reduced during backward) does neither: backward's kernels run on
    while NCCL works on its own stream, and :meth:`join` makes the step wait once, before
    the optimizer reads the gradients (what DDP's reducer does).

    The communicator is made at construction, under the watchdog's guard (:meth:`_connect`):
    torch makes a process group's NCCL communicator lazily, inside its first collective,
    unless the group is bound to a device (``init_process_group(device_id=...)``); hadpsgd
    builds the backend itself, so it binds it here, then runs one small allreduce and waits
    for it. A node whose GPUs cannot talk, or a learner that never joins, fails at start-up
    naming the node's ranks, not inside the first training step. The rendezvous store waits
    ``HADPSGD_TIMEOUT`` (:class:`~hadpsgd.comm.backends.TorchIntra`).

    Raises:
        ImportError: If torch was built without NCCL.
    """

    name = "nccl"

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int],
                 device: torch.device, scope: str = "intra-node") -> None:
        ok, why = nccl_available()
        if not ok:
            raise ImportError(f"the nccl intra-node backend is not usable: {why} (or choose "
                              "--intra-backend mpi)")
        self.device = device
        self._deferred: list[Any] = []
        self._owed: str | None = None  # a joined mean whose host wait is left to settle()
        super().__init__(comm, watchdog, world_ranks, scope)
        free_before = _free_device_bytes(device)
        self.connect_s = self._connect()
        """Seconds the communicator took to make and to pass its first allreduce."""
        free_after = _free_device_bytes(device)
        self.device_bytes: int | None = (max(0, free_before - free_after)
                                         if free_before is not None and free_after is not None
                                         else None)
        """The fall in the GPU's free memory across :meth:`_connect`: the communicator's own
        buffers, outside torch's allocator (besides the probe's block of that allocator, 2 MiB
        where it is the first on the device). The start-up line
        sums it over the rank's groups (:meth:`~hadpsgd.comm.topology.Topology.
        torch_group_bytes`). A lower bound: NCCL from 2.22 connects lazily by default
        (``NCCL_RUNTIME_CONNECT``), so the buffers of the algorithms the one-element probe did
        not use (larger rings, reduce-scatter, NVLink SHARP) come at their first use."""

    def _connect(self) -> float:
        """Make the NCCL communicator now, under the deadline; return the seconds it took.

        ``eager_connect_single_device`` is what ``init_process_group(device_id=...)`` calls:
        it binds the group to this learner's GPU and makes the communicator (the NCCL unique
        id through the store, ``ncclCommInitRank``), blocking the host with the GIL
        released. An allreduce of one element follows: where torch makes an eagerly bound
        communicator non-blocking, that is where it is waited for, and it shows that the
        GPUs can talk. Every call runs under the watchdog's guard: past the deadline it
        names the peers that never arrived and ends the job.

        Raises:
            CommTimeoutError: The store gave up waiting for a peer (named in the message).
            RuntimeError: NCCL could not make the communicator (naming the node's ranks).
        """
        what = f"{self.scope} NCCL communicator set-up on {self.device} (nccl)"
        start = time.monotonic()
        probe = torch.ones(1, device=self.device)
        try:
            with self.watchdog.guard(what, self.world_ranks):
                eager = getattr(self.pg, "eager_connect_single_device", None)
                if eager is not None:  # torch >= 2.3; older ones make it in the allreduce
                    eager(self.device)
                self.pg.allreduce([probe]).wait()  # the stream waits (the host may, too)
        except RuntimeError as err:
            if "imeout" in str(err) or "imed out" in str(err):  # the store's wait: who is late
                self.watchdog.fail(what, self.world_ranks)
            raise RuntimeError(
                f"rank {self.world_ranks[self.rank]}: the NCCL communicator of the node's ranks "
                f"{self.world_ranks} could not be made on {self.device}: {err}. Check that the "
                "node's GPUs can reach each other (nvidia-smi topo -m, NCCL_DEBUG=INFO), or "
                "use --intra-backend mpi") from err
        self._host_wait("start-up allreduce")
        if float(probe.item()) != self.size:
            raise RuntimeError(f"rank {self.world_ranks[self.rank]}: the NCCL start-up "
                               f"allreduce over ranks {self.world_ranks} gave "
                               f"{float(probe.item())}, not {self.size}")
        return time.monotonic() - start

    def _make_group(self, store: Any, timeout: datetime.timedelta) -> Any:
        opts = self._dist.ProcessGroupNCCL.Options()
        # Past hadpsgd's own deadline: hadpsgd names a missing peer before NCCL kills us.
        opts._timeout = nccl_timeout(timeout.total_seconds())
        return self._dist.ProcessGroupNCCL(store, self.rank, self.size, opts)

    def _op(self, avg: bool) -> Any:
        # NCCL averages in the reduction itself (ncclAvg): no division kernel afterwards.
        return self._dist.ReduceOp.AVG if avg else self._dist.ReduceOp.SUM

    def _host_wait(self, what: str) -> None:
        """Block the host until the current stream's work is done, under the deadline."""
        # A blocking-sync event: the host thread sleeps in the driver until the event
        # completes (no core spun), with the GIL released. The wait cannot be interrupted,
        # so like a blocking MPI call it runs under the watchdog's guard: past the deadline
        # the monitor thread names the missing peers and aborts the job.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        try:
            with self.watchdog.guard(f"{self.scope} {what} (nccl)", self.world_ranks):
                event.synchronize()
        except Exception:
            self.pg.abort()
            raise

    def _wait(self, work: Any, what: str) -> None:
        work.wait()  # the current stream waits for the NCCL stream (no host block)
        self._host_wait(what)

    def allreduce_deferred_(self, t: torch.Tensor, avg: bool = True) -> None:
        """Start a sum (or mean) of ``t`` over the node that completes by :meth:`join`.

        Nothing waits for it here: the caller's stream runs on, and ``t`` must not be read
        until :meth:`join` returns.
        """
        self._admit(t)
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = self._op(avg)
        self._deferred.append(self.pg.allreduce([t], opts))

    def join(self, what: str = "gradient allreduce", host_wait: bool = True) -> None:
        """Make the current stream wait for every deferred allreduce; one host wait.

        With ``host_wait=False`` the host wait is owed instead: :meth:`settle` makes it,
        after whatever the caller queues behind the means (the step's finiteness and norm,
        read in the same wait: one host synchronisation a step, not two).
        """
        if not self._deferred:
            return
        works, self._deferred = self._deferred, []
        for work in works:
            work.wait()
        if host_wait:
            self._host_wait(what)
        else:
            self._owed = what

    def settle(self) -> bool:
        """Make the host wait owed by :meth:`join` (under the deadline), if one is owed.

        The host sleeps until everything queued on the current stream so far is done: the
        joined means and what came after them.

        Returns:
            Whether it waited (False: nothing was owed, and nothing was waited for).
        """
        what, self._owed = self._owed, None
        if what is None:
            return False
        self._host_wait(what)
        return True

    def _admit(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"NCCL got a tensor on {t.device}, not on this learner's "
                                 f"{self.device}: host tensors take the MPI path")

    def close(self) -> None:  # noqa: D102
        self._deferred, self._owed = [], None
        try:
            self.pg.shutdown()
        except (AttributeError, RuntimeError):
            pass
        super().close()
