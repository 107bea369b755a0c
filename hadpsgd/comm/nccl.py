"""Intra-node NCCL through torch.distributed's own process group, bootstrapped over MPI.

Why torch.distributed and not CuPy's NCCL bindings: every CUDA build of torch ships NCCL, so
a GPU run needs no second package whose CUDA version must match (a missing or mismatched
CuPy was the silent fall-back to host staging); the process group orders its work with
torch's streams and caching allocator; and it shares :class:`TorchIntra` with the gloo
backend, so the CPU test suite runs the very calls NCCL receives.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from hadpsgd.comm.backends import TorchIntra
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


class NCCLIntra(TorchIntra):
    """NCCL collectives on device tensors among the GPUs of one node.

    Operations run on the process group's NCCL stream, which waits for the current stream
    (so they see the gradients just computed); the current stream then waits for them, and
    the host blocks on a blocking-sync CUDA event under the watchdog's guard, so a stuck
    peer ends the job with a named error instead of a hang (and a failed wait aborts the
    communicator).

    Raises:
        ImportError: If torch was built without NCCL.
    """

    name = "nccl"

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int],
                 device: torch.device) -> None:
        ok, why = nccl_available()
        if not ok:
            raise ImportError(f"the nccl intra-node backend is not usable: {why} (or choose "
                              "--intra-backend mpi)")
        self.device = device
        super().__init__(comm, watchdog, world_ranks)

    def _make_group(self, store: Any, timeout: datetime.timedelta) -> Any:
        opts = self._dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return self._dist.ProcessGroupNCCL(store, self.rank, self.size, opts)

    def _wait(self, work: Any, what: str) -> None:
        work.wait()  # the current stream waits for the NCCL stream (no host block)
        # A blocking-sync event: the host thread sleeps in the driver until the event
        # completes and is woken then (no polling pause to oversleep, no core spun), with
        # the GIL released. The wait cannot be interrupted, so like a blocking MPI call it
        # runs under the watchdog's guard: past the deadline the monitor thread names the
        # missing peers and aborts the job.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        try:
            with self.watchdog.guard(f"intra-node {what} (nccl)", self.world_ranks):
                event.synchronize()
        except Exception:
            self.pg.abort()
            raise

    def _admit(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"NCCL got a tensor on {t.device}, not on this learner's "
                                 f"{self.device}: host tensors take the MPI path")

    def close(self) -> None:  # noqa: D102
        try:
            self.pg.shutdown()
        except (AttributeError, RuntimeError):
            pass
        super().close()
