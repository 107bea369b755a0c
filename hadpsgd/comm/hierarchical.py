"""Two-level reductions: intra-node backend + MPI between nodes, bucket by bucket.

Three forms of a global sum, chosen by :class:`Reducer` per call:

- ``flat``: one MPI allreduce over all learners.
- ``shard`` (equal node sizes): intra-node reduce-scatter, then every local rank allreduces
  its shard with the same local rank of the other nodes (all node-to-node links busy in
  parallel), then intra-node allgather.
- ``leader``: intra-node reduce to local rank 0, allreduce among the node leaders, intra-node
  broadcast (works for unequal node sizes).

Every form leaves bit-identical results on all learners: the final value is computed once
and then copied (allgather / broadcast).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from hadpsgd.comm.backends import IntraBackend
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.flat import zeros
from hadpsgd.comm.mpi import MPI_NATIVE
from hadpsgd.comm.staging import Stager

HierAlgo = Literal["auto", "shard", "leader"]
Path = Literal["auto", "flat", "hier"]


class Reducer:
    """Sums flat tensors over the world, a node, or across nodes.

    Args:
        world: World communicator.
        inter: Communicator of the same local rank across nodes.
        intra: Intra-node backend.
        watchdog: Deadline keeper.
        inter_ranks: World ranks in ``inter`` (for naming a missing one).
        node_sizes: Learners per node (equal sizes enable the shard form).
        bucket_bytes: Bytes per bucket: large buffers go in pieces of this size.
        hier_algo: ``shard``, ``leader`` or ``auto`` (shard when node sizes are equal).
        cuda_aware: Whether MPI accepts device buffers.
    """

    def __init__(self, world: Any, inter: Any, intra: IntraBackend, watchdog: Watchdog,
                 inter_ranks: list[int], node_sizes: list[int], bucket_bytes: int,
                 hier_algo: HierAlgo = "auto", cuda_aware: bool = False) -> None:
        self.world = world
        self.inter = inter
        self.intra = intra
        self.watchdog = watchdog
        self.inter_ranks = inter_ranks
        self.num_nodes = len(node_sizes)
        # Decided from the global layout, never from this node alone: every rank must take
        # the same path or the collectives would not match.
        self.hierarchical = self.num_nodes > 1 and max(node_sizes) > 1
        equal_nodes = len(set(node_sizes)) == 1
        self.bucket_bytes = max(int(bucket_bytes), 8)
        if hier_algo == "shard" and not equal_nodes:
            raise ValueError("hier_algo='shard' needs nodes of equal size; use 'leader'")
        self.algo = ("shard" if equal_nodes else "leader") if hier_algo == "auto" else hier_algo
        self.cuda_aware = cuda_aware
        self.stager = Stager()
        self._scratch: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}

    # ------------------------------------------------------------------ MPI helpers
    def _mpi_allreduce_(self, comm: Any, t: torch.Tensor, what: str,
                        group: list[int] | None) -> None:
        """In-place MPI sum of ``t`` over ``comm``, staging device memory when needed."""
        from mpi4py import MPI

        if comm.Get_size() == 1:
            return

        def op(buf: Any) -> None:
            with self.watchdog.guard(what, group):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        if t.is_cuda and not self.cuda_aware:
            self.stager.run_staged(t, self._elems(t), op)
        elif t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
            op(t)
        else:
            op(t.numpy())

    def _scratch_for(self, t: torch.Tensor, numel: int, slot: int) -> torch.Tensor:
        key = (t.dtype, t.device, slot)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = zeros(numel, t.dtype, t.device)
            self._scratch[key] = buf
        return buf[:numel]

    # ------------------------------------------------------------------ sums
    def world_sum_(self, t: torch.Tensor, path: Path = "auto") -> None:
        """Sum the 1-D ``t`` over all learners in place."""
        if path == "flat" or (path == "auto" and not self.hierarchical):
            if self.num_nodes == 1 and path == "auto":
                self._buckets(t, self.intra_sum_)  # one node: the fast intra path only
            else:
                self._buckets(t, lambda b: self._mpi_allreduce_(
                    self.world, b, f"allreduce of {b.numel()} {b.dtype}", None))
            return
        self._buckets(t, self._hier_bucket)

    def intra_sum_(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the learners of this node.

        CUDA tensors use the NCCL backend, or are staged through host memory for the others.
        """
        if self.intra.size == 1:
            return
        if not self._via_host(t, self.intra.allreduce_):
            self.intra.allreduce_(t)

    def intra_bcast_(self, t: torch.Tensor, root: int = 0) -> None:
        """Copy local rank ``root``'s ``t`` to every learner of this node."""
        if self.intra.size == 1:
            return
        if not self._via_host(t, lambda h: self.intra.bcast_(h, root)):
            self.intra.bcast_(t, root)

    def inter_sum_(self, t: torch.Tensor) -> None:
        """Sum ``t`` across nodes, assuming it is identical on the learners of each node.

        That is the case for a super-learner's model: each local rank carries one shard, then
        the node allgathers the shards, so every learner ends with the same bits.
        """
        if self.num_nodes == 1:
            return
        self._buckets(t, self._inter_bucket)

    # ------------------------------------------------------------------ per bucket
    def _elems(self, t: torch.Tensor) -> int:
        return max(1, self.bucket_bytes // t.element_size())

    def _buckets(self, t: torch.Tensor, fn: Any) -> None:
        n, step = t.numel(), self._elems(t)
        if n <= step:
            fn(t)
            return
        for lo in range(0, n, step):
            fn(t[lo:lo + step])

    def _padded(self, b: torch.Tensor) -> tuple[torch.Tensor, int]:
        ls = self.intra.size
        shard = -(-b.numel() // ls)
        if shard * ls == b.numel():
            return b, shard
        padded = self._scratch_for(b, shard * ls, slot=0)
        padded[:b.numel()].copy_(b)
        padded[b.numel():].zero_()
        return padded, shard

    def _host_intra(self, b: torch.Tensor) -> bool:
        return b.is_cuda and self.intra.name != "nccl"

    def _via_host(self, t: torch.Tensor, fn: Any) -> bool:
        """Apply ``fn`` to a host copy of ``t`` if the intra-node backend needs host memory.

        That is a device tensor with the MPI or gloo backend; otherwise nothing is done and
        the result is False.
        """
        if not self._host_intra(t):
            return False
        host = self.stager.buffer(t.dtype, t.numel(), slot=2)
        host.copy_(t)
        fn(host)
        t.copy_(host)
        return True

    def _hier_bucket(self, b: torch.Tensor) -> None:
        if self._via_host(b, self._hier_bucket):
            return
        what = f"inter-node allreduce of {b.numel()} {b.dtype}"
        if self.algo == "shard":
            padded, shard = self._padded(b)
            mine = self._scratch_for(b, shard, slot=1)
            self.intra.reduce_scatter_(padded, mine)
            self._mpi_allreduce_(self.inter, mine, what, self.inter_ranks)
            self.intra.allgather_(mine, padded)
            if padded.data_ptr() != b.data_ptr():
                b.copy_(padded[:b.numel()])
        else:
            self.intra.reduce_(b, root=0)
            if self.intra.rank == 0:
                self._mpi_allreduce_(self.inter, b, what, self.inter_ranks)
            self.intra.bcast_(b, root=0)

    def _inter_bucket(self, b: torch.Tensor) -> None:
        if self._via_host(b, self._inter_bucket):
            return
        what = f"inter-node allreduce of {b.numel()} {b.dtype}"
        if self.algo == "shard" and self.intra.size > 1:
            padded, shard = self._padded(b)
            mine = self._scratch_for(b, shard, slot=1)
            lo = self.intra.rank * shard
            mine.copy_(padded[lo:lo + shard])
            self._mpi_allreduce_(self.inter, mine, what, self.inter_ranks)
            self.intra.allgather_(mine, padded)
            if padded.data_ptr() != b.data_ptr():
                b.copy_(padded[:b.numel()])
        else:
            if self.intra.rank == 0:
                self._mpi_allreduce_(self.inter, b, what, self.inter_ranks)
            if self.intra.size > 1:
                self.intra.bcast_(b, root=0)


def as_native(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous tensor MPI can reduce, and whether it is a copy to write back.

    Half precision goes to float32: MPI has no portable half type.
    """
    native = t.dtype in MPI_NATIVE
    if native and t.is_contiguous():
        return t, False
    return t.detach().to(torch.float32 if not native else t.dtype).contiguous(), True


__all__ = ["HierAlgo", "Path", "Reducer", "as_native"]
