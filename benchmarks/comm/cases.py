"""The measured operations of ``python -m benchmarks.comm``: hadpsgd's and their baselines.

A :class:`Case` is one variant of an op at one message size: how to run it once (the timed
unit), how to fill its buffers with rank-dependent data and check one result. :class:`Cases`
builds them for one layout: hadpsgd's collectives on the topology's device, and the raw mpi4py
(and gloo) baselines written as a user would write them for the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks._common.timing import nothing
from hadpsgd.comm import Topology
from hadpsgd.comm.flat import zeros as flat_zeros
from hadpsgd.comm.hierarchical import ReducePath

Buffer = Any
"""A float32 torch tensor (CPU or CUDA) or NumPy array (all accept ``buf[...] = v``, ``==``)."""


class BenchError(RuntimeError):
    """A case produced a wrong result, or the benchmark cannot run on this layout."""


@dataclass
class Case:
    """One variant of an op at one size: how to run it once, and how to check one result.

    Attributes:
        label: Name for messages (``hadpsgd allreduce/flat``, ``mpi4py Bcast``...).
        run: One operation (the timed unit).
        fill: Put rank-dependent data in the buffers before the checked run.
        verify: After one run on filled data: whether this rank's result is right.
        reset: After the check: data for the timed runs (zeros, so repeated sums stay finite).
    """

    label: str
    run: Callable[[], None]
    fill: Callable[[], None]
    verify: Callable[[], bool]
    reset: Callable[[], None] = nothing


class Cases:
    """Builds the cases of every op for one layout.

    The buffers live on the topology's device, and the cases of one size share them (see
    :meth:`_buffer`). The raw mpi4py baselines (``raw`` buffers) are NumPy arrays on CPU;
    on CUDA they are device tensors handed to MPI through :meth:`_raw`, with the host copies
    (``direct=False``) or as they are (``direct=True``, CUDA-aware MPI only).

    Args:
        topo: The hadpsgd topology.
        mpi: The ``mpi4py.MPI`` module.
        gloo: A gloo process group over the world, or ``None`` to skip that baseline.
    """

    def __init__(self, topo: Topology, mpi: Any, gloo: Any | None) -> None:
        self.topo = topo
        self.mpi = mpi
        self.gloo = gloo
        self.device = topo.device
        self.on_gpu = topo.device.type == "cuda"
        self.value = float(topo.rank + 1)
        n = topo.size
        self.world_sum = n * (n + 1) / 2
        self.node_sum = float(sum(topo.node_ranks) + topo.local_size)
        self.peer = topo.rank ^ 1 if (topo.rank ^ 1) < n else None
        self._buffers: dict[int, tuple[int, np.ndarray | None, torch.Tensor]] = {}

    def _buffer(self, count: int, raw: bool, slot: int = 0) -> Buffer:
        """Buffer ``slot`` of ``count`` elements: the raw view (NumPy on CPU) or hadpsgd's.

        Every case of one size, baseline or hadpsgd's, works on the same memory: one
        allocation per slot, kept until the size changes. Where a buffer comes from decides
        how fast MPI moves it (glibc serves a size it has just freed from the heap rather
        than a fresh mapping, and Open MPI moved the two kinds up to 40 % apart at 4-16 MiB
        on 2 ranks here), so cases allocated one after the other were not comparable. On
        CPU the memory is NumPy's: the raw baselines get the array, hadpsgd a tensor over
        it, as its own flat buffers are (``hadpsgd.comm.flat.zeros``).
        """
        held = self._buffers.get(slot)
        if held is None or held[0] != count:
            self._buffers.pop(slot, None)  # the last size's memory goes first
            if self.on_gpu:
                array, tensor = None, flat_zeros(count, torch.float32, self.device)
            else:
                array = np.zeros(count, dtype=np.float32)
                tensor = torch.from_numpy(array)
            held = self._buffers[slot] = (count, array, tensor)
        return held[1] if raw and not self.on_gpu else held[2]

    def _variant(self, direct: bool) -> str:
        if not self.on_gpu:
            return ""
        return " (device buffers)" if direct else " (host copies)"

    def _raw(self, call: Callable[..., None], count: int, direct: bool, nbufs: int = 1,
             inputs: Sequence[int] = (0,), outputs: Sequence[int] = (0,)) -> Callable[..., None]:
        """Raw mpi4py ``call`` on the case's buffers, written as a user would for them.

        On CPU ``call`` receives the NumPy buffers themselves. On CUDA with ``direct`` it
        receives the device tensors once the stream has finished writing them (CUDA-aware
        MPI reads device memory itself). Otherwise the ``inputs`` are copied into pinned host
        tensors allocated once here, ``call`` works on their NumPy views, the ``outputs`` are
        copied back and the stream synchronized: the copies are part of the time.

        Args:
            call: The MPI call on ``nbufs`` buffers.
            count: Elements per buffer.
            direct: Hand MPI the device tensors (CUDA only).
            nbufs: Buffers of the case.
            inputs: Which buffers MPI reads (copied to the host first).
            outputs: Which buffers MPI writes (copied back to the device after).
        """
        if not self.on_gpu:
            return call
        stream = torch.cuda.current_stream(self.device)
        if direct:
            def on_device(*bufs: torch.Tensor) -> None:
                stream.synchronize()  # MPI does not order itself after queued kernels
                call(*bufs)

            return on_device
        hosts = [torch.empty(count, dtype=torch.float32, pin_memory=True) for _ in range(nbufs)]
        arrays = [h.numpy() for h in hosts]

        def through_host(*bufs: torch.Tensor) -> None:
            for i in inputs:
                hosts[i].copy_(bufs[i])
            call(*arrays)
            for i in outputs:
                bufs[i].copy_(hosts[i])
            stream.synchronize()

        return through_host

    def _reduction(self, label: str, count: int, expected: float, op: Callable[[Buffer], None],
                   raw: bool = False) -> Case:
        buf = self._buffer(count, raw)

        def fill() -> None:
            buf[...] = self.value

        def reset() -> None:
            buf[...] = 0

        return Case(label, lambda: op(buf), fill, lambda: bool((buf == expected).all()), reset)

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, view: Topology, path: ReducePath, count: int) -> Case:
        """``Topology.allreduce_`` (sum) over the world on ``path`` with ``view``'s backend."""
        return self._reduction(f"hadpsgd allreduce/{path} ({view.intra_backend})", count,
                               self.world_sum,
                               lambda t: view.allreduce_(t, op="sum", path=path))

    def intra(self, view: Topology, count: int) -> Case:
        """``Topology.intra_allreduce_`` (sum) with ``view``'s intra-node backend."""
        return self._reduction(f"hadpsgd intra_allreduce_ ({view.intra_backend})", count,
                               self.node_sum, lambda t: view.intra_allreduce_(t, op="sum"))

    def mpi_allreduce(self, count: int, intra: bool = False, direct: bool = False) -> Case:
        """Raw ``Allreduce(IN_PLACE, SUM)`` on the world (or the node) communicator."""
        comm = self.topo.intra if intra else self.topo.comm
        mpi = self.mpi
        call = self._raw(lambda a: comm.Allreduce(mpi.IN_PLACE, a, op=mpi.SUM), count, direct)
        return self._reduction("mpi4py Allreduce" + (" (node)" if intra else "")
                               + self._variant(direct), count,
                               self.node_sum if intra else self.world_sum, call, raw=True)

    def gloo_allreduce(self, count: int) -> Case:
        """torch.distributed gloo ``allreduce`` (sum) over the world."""
        pg = self.gloo
        return self._reduction("gloo allreduce", count, self.world_sum,
                               lambda t: pg.allreduce([t]).wait())

    # ------------------------------------------------------------------ broadcast
    def _bcast(self, label: str, count: int, op: Callable[[Buffer], None], raw: bool) -> Case:
        buf = self._buffer(count, raw)

        def fill() -> None:
            buf[...] = self.value

        return Case(label, lambda: op(buf), fill, lambda: bool((buf == 1.0).all()))

    def broadcast(self, count: int) -> Case:
        """``Topology.broadcast_`` from rank 0."""
        return self._bcast("hadpsgd broadcast_", count, lambda t: self.topo.broadcast_(t, 0),
                           raw=False)

    def mpi_bcast(self, count: int, direct: bool = False) -> Case:
        """Raw ``Bcast`` from rank 0."""
        world = self.topo.comm
        call = self._raw(lambda a: world.Bcast(a, root=0), count, direct)
        return self._bcast("mpi4py Bcast" + self._variant(direct), count, call, raw=True)

    # ------------------------------------------------------------------ pair exchange
    def _pair(self, label: str, count: int, op: Callable[[Buffer, Buffer, int], None],
              raw: bool) -> Case:
        send, recv = self._buffer(count, raw, 0), self._buffer(count, raw, 1)
        peer = self.peer

        def fill() -> None:
            send[...] = self.value
            recv[...] = 0

        if peer is None:  # the odd rank out of an odd world idles
            return Case(label, nothing, nothing, lambda: True)
        return Case(label, lambda: op(send, recv, peer), fill,
                    lambda: bool((recv == float(peer + 1)).all()))

    def exchange(self, count: int) -> Case:
        """``Topology.exchange`` with the even/odd partner."""
        return self._pair("hadpsgd exchange", count,
                          lambda s, r, p: self.topo.exchange(s, r, p, tag=0), raw=False)

    def mpi_sendrecv(self, count: int, direct: bool = False) -> Case:
        """Raw ``Sendrecv`` with the even/odd partner."""
        world = self.topo.comm
        peer = self.peer

        def sendrecv(s: Buffer, r: Buffer) -> None:
            world.Sendrecv(s, dest=peer, sendtag=0, recvbuf=r, source=peer, recvtag=0)

        # Only the send buffer goes to the host and only the receive buffer comes back.
        call = self._raw(sendrecv, count, direct, nbufs=2, inputs=(0,), outputs=(1,))
        return self._pair("mpi4py Sendrecv" + self._variant(direct), count,
                          lambda s, r, p: call(s, r), raw=True)

