"""Intra-node NCCL through CuPy: the unique id is broadcast over MPI (no TCP store)."""

from __future__ import annotations

from typing import Any

import torch

from hadpsgd.comm.backends import IntraBackend
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.objects import bcast_object

_NCCL_TYPES = {torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64",
               torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16",
               torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64", torch.uint8: "NCCL_UINT8"}


def nccl_available() -> bool:
    """Whether CuPy with NCCL support can be imported."""
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


class NCCLIntra(IntraBackend):
    """NCCL collectives on device tensors among the GPUs of one node.

    Operations are enqueued on torch's current CUDA stream, so they order correctly with the
    computation that produced the gradients; completion is awaited through a CUDA event polled
    under the watchdog's deadline (a stuck NCCL call aborts the communicator).

    Raises:
        ImportError: If CuPy is missing: ``pip install 'hadpsgd[gpu]'``.
    """

    name = "nccl"

    def __init__(self, comm: Any, watchdog: Watchdog, world_ranks: list[int],
                 device: torch.device) -> None:
        super().__init__(comm, watchdog, world_ranks)
        try:
            from cupy.cuda import nccl
        except Exception as err:  # noqa: BLE001
            raise ImportError(
                "the NCCL intra-node backend needs CuPy: pip install 'hadpsgd[gpu]' "
                "(or choose --intra-backend mpi)"
            ) from err
        self._nccl = nccl
        self.device = device
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = bcast_object(comm, watchdog, uid, root=0, group=world_ranks)
        with torch.cuda.device(device):
            self.nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)

    def _args(self, t: torch.Tensor) -> tuple[int, int, int]:
        dtype = getattr(self._nccl, _NCCL_TYPES[t.dtype])
        return t.data_ptr(), t.numel(), dtype

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _wait(self, what: str) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        try:
            self.watchdog.wait_until(event.query, f"intra-node {what} (nccl)", self.world_ranks)
        except Exception:
            self.nccl_comm.abort()
            raise

    def allreduce_(self, t: torch.Tensor) -> None:  # noqa: D102
        ptr, n, dt = self._args(t)
        self.nccl_comm.allReduce(ptr, ptr, n, dt, self._nccl.NCCL_SUM, self._stream())
        self._wait("allreduce")

    def reduce_scatter_(self, t: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        _, _, dt = self._args(t)
        self.nccl_comm.reduceScatter(t.data_ptr(), out.data_ptr(), out.numel(), dt,
                                     self._nccl.NCCL_SUM, self._stream())
        self._wait("reduce-scatter")

    def allgather_(self, shard: torch.Tensor, out: torch.Tensor) -> None:  # noqa: D102
        _, _, dt = self._args(shard)
        self.nccl_comm.allGather(shard.data_ptr(), out.data_ptr(), shard.numel(), dt,
                                 self._stream())
        self._wait("allgather")

    def reduce_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        ptr, n, dt = self._args(t)
        self.nccl_comm.reduce(ptr, ptr, n, dt, self._nccl.NCCL_SUM, root, self._stream())
        self._wait("reduce")

    def bcast_(self, t: torch.Tensor, root: int = 0) -> None:  # noqa: D102
        ptr, n, dt = self._args(t)
        self.nccl_comm.bcast(ptr, n, dt, root, self._stream())
        self._wait("broadcast")

    def close(self) -> None:  # noqa: D102
        self.nccl_comm.destroy()
