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

Which backend a tensor meets is decided by the tensor itself (:func:`route`): a device
tensor goes to the device backend (NCCL) when there is one; a host tensor (the loop's
control vector, evaluation totals, ADPSGD's flag) always goes to the host backend (MPI or
gloo), so NCCL never sees a host pointer. A device tensor without a device backend goes
straight to a CUDA-aware MPI (the BMUF-Adam layout of one learner per node, or MPI chosen
inside the node); otherwise it, and a host tensor of a dtype MPI lacks, runs the whole
operation on staged host copies.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch

from hadpsgd.comm.backends import IntraBackend, MPIIntra
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.direct import Direct, mpi_consts
from hadpsgd.comm.flat import zeros
from hadpsgd.comm.hostlink import HostLink, shard_sum_
from hadpsgd.comm.mpi import MPI_NATIVE
from hadpsgd.comm.staging import Stager, wait_device

HierAlgo = Literal["auto", "shard", "leader"]
ReducePath = Literal["auto", "flat", "hier"]
"""How a world sum goes: hierarchical (``hier``), one flat MPI allreduce, or ``auto``."""


class Route(NamedTuple):
    """The path one tensor takes through a reduction (see :func:`route`)."""

    intra: str
    """Inside the node: the backend's name, or ``<name> via host`` when staged."""
    inter: str
    """Between nodes: ``mpi`` on host memory, ``mpi (device buffers)`` when CUDA-aware, or
    ``mpi via host`` when staged; ``nccl on one host`` (and MPI's route ``between hosts``)
    where super-learners share a host (:mod:`hadpsgd.comm.hostlink`)."""


def route(device_type: str, dtype: torch.dtype, host_backend: str, device_backend: str | None,
          cuda_aware: bool) -> Route:
    """The path a tensor on ``device_type`` of ``dtype`` takes (pure: testable without a GPU).

    Args:
        device_type: ``cpu`` or ``cuda``.
        dtype: The tensor's dtype.
        host_backend: Intra-node backend for host tensors (``mpi`` or ``gloo``).
        device_backend: Intra-node backend for device tensors (``nccl``) or None.
        cuda_aware: Whether MPI accepts device buffers.
    """
    native = dtype in MPI_NATIVE
    if device_type == "cuda" and device_backend is not None:
        inter = "mpi (device buffers)" if cuda_aware and native else "mpi via host"
        return Route(device_backend, inter)
    if device_type == "cuda" and device_direct(dtype, host_backend, cuda_aware):
        return Route(f"{host_backend} (device buffers)", "mpi (device buffers)")
    if device_type == "cuda" or not native:
        return Route(f"{host_backend} via host", "mpi via host")
    return Route(host_backend, "mpi")


def device_direct(dtype: torch.dtype, host_backend: str, cuda_aware: bool) -> bool:
    """Whether a device tensor without a device backend goes to MPI as it is (no staging).

    That needs a CUDA-aware MPI, a dtype MPI reduces, and MPI (not gloo) inside the node.
    """
    return cuda_aware and dtype in MPI_NATIVE and host_backend == "mpi"


ReduceScope = Literal["auto", "flat", "hier", "intra", "inter"]
"""What a direct sum spans: a :data:`ReducePath` of the world sum, the node, or across nodes."""

class Reducer:
    """Sums flat tensors over the world, a node, or across nodes.

    The common case, a contiguous host tensor of an MPI type that fits in one bucket on a
    scope that is one MPI allreduce (the flat world sum, a one-node world or node with the
    MPI backend, nodes of one rank each), goes straight to that one guarded call
    (:meth:`direct_sum_`): small messages pay no more than MPI itself.

    Args:
        world: World communicator.
        inter: Communicator of the same local rank across nodes.
        intra: Intra-node backend for host tensors (``mpi`` or ``gloo``).
        watchdog: Deadline keeper.
        inter_ranks: World ranks in ``inter`` (for naming a missing one).
        node_sizes: Learners per node (equal sizes enable the shard form).
        bucket_bytes: Bytes per bucket: large buffers go in pieces of this size.
        hier_algo: ``shard``, ``leader`` or ``auto`` (shard when node sizes are equal).
        cuda_aware: Whether MPI accepts device buffers.
        device_intra: Intra-node backend for device tensors (NCCL), or None to stage them.
        host_link: The cross-node leg between super-learners that share a host (NCCL,
            :mod:`hadpsgd.comm.hostlink`), for the tensors it takes; None: MPI throughout.
    """

    def __init__(self, world: Any, inter: Any, intra: IntraBackend, watchdog: Watchdog,
                 inter_ranks: list[int], node_sizes: list[int], bucket_bytes: int,
                 hier_algo: HierAlgo = "auto", cuda_aware: bool = False,
                 device_intra: IntraBackend | None = None,
                 host_link: HostLink | None = None) -> None:
        self.world = world
        self.inter = inter
        self.intra = intra
        self.device_intra = device_intra
        self.host_link = host_link
        self.watchdog = watchdog
        self.inter_ranks = inter_ranks
        self.num_nodes = len(node_sizes)
        self.local_size = intra.size
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
        self._plans: dict[str, Direct | None] = {}
        self._mpi: tuple[Any, Any] | None = None  # (MPI.IN_PLACE, MPI.SUM), on first use

    def route(self, t: torch.Tensor) -> Route:
        """The path ``t`` takes in this reducer's reductions."""
        path = route(t.device.type, t.dtype, self.intra.name,
                     self.device_intra.name if self.device_intra is not None else None,
                     self.cuda_aware)
        link = self.host_link
        if link is None or not link.takes(t):
            return path
        between = f", {path.inter} between hosts" if link.hosts > 1 else ""
        return path._replace(inter=f"{link.name} on one host{between}")

    def _linked(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s cross-node leg goes through the host link (not MPI throughout)."""
        return self.host_link is not None and self.host_link.takes(t)

    def _backend(self, t: torch.Tensor) -> IntraBackend:
        return self.device_intra if t.is_cuda and self.device_intra is not None else self.intra

    def _staged(self, t: torch.Tensor, fn: Any) -> bool:
        """Run ``fn`` on staged host copies of ``t`` if its route goes via the host.

        That is a device tensor without a device backend, or a host tensor of a dtype MPI
        lacks; otherwise nothing is done and the result is False.
        """
        if t.is_cuda:
            if (self.device_intra is not None or self._linked(t)
                    or device_direct(t.dtype, self.intra.name, self.cuda_aware)):
                return False
        elif t.dtype in MPI_NATIVE:
            return False
        self.stager.run_staged(t, fn)
        return True

    # ------------------------------------------------------------------ deferred means
    def mean_deferred_(self, t: torch.Tensor, scope: str) -> bool:
        """Start the mean of device tensor ``t`` over ``scope`` without waiting, if possible.

        Possible when the whole route is one NCCL allreduce (``intra``, or ``world`` in a
        one-node world, or ``world`` of super-learners of one that all share a host: the
        host link's group, issue 59 item 7): it runs on NCCL's stream while the caller's
        stream goes on, and
        :meth:`join_deferred` ends it. Anything else (an MPI leg, staging) must wait and is
        left to the caller (False): the gradient buckets' background thread then runs it on
        its own stream (:class:`~hadpsgd.comm.streams.ReadyEvents`), where NCCL and the
        copies wait for that bucket only and the host waits only for that stream's events.
        """
        group = self._deferring(scope) if t.is_cuda else None
        if group is None:
            return False
        group.allreduce_deferred_(t, avg=True)  # type: ignore[attr-defined]
        return True

    def _deferring(self, scope: str) -> IntraBackend | None:
        """The NCCL group whose one allreduce is the whole mean over ``scope``, or None."""
        if self.local_size > 1:
            dev = self.device_intra
            whole = scope == "intra" or (scope == "world" and self.num_nodes == 1)
            return dev if whole and hasattr(dev, "allreduce_deferred_") else None
        link = self.host_link  # super-learners of one: the world is ``inter``
        group = link.local if link is not None and link.hosts == 1 else None
        if (scope == "world" and self.num_nodes > 1 and group is not None
                and group.size == self.num_nodes and hasattr(group, "allreduce_deferred_")):
            return group
        return None

    def deferrable(self, scope: str) -> bool:
        """Whether :meth:`mean_deferred_` takes a device tensor over ``scope``.

        Ask first where the tensor to send is a copy made for it (a bf16 cast).
        """
        return self._deferring(scope) is not None

    def _deferred_groups(self) -> list[Any]:
        """The groups a deferred mean may be pending on (the node's, the host link's)."""
        link = self.host_link
        found = [self.device_intra, link.local if link is not None else None]
        return [g for i, g in enumerate(found) if g is not None and g not in found[:i]]

    def join_deferred(self, host_wait: bool = True) -> None:
        """Make the current stream wait for every deferred mean (one host wait, or owed)."""
        for group in self._deferred_groups():
            join = getattr(group, "join", None)
            if join is not None:
                join(host_wait=host_wait)

    def settle_deferred(self) -> bool:
        """Make the host wait that :meth:`join_deferred` left owed, if any; whether it did."""
        settled = False
        for group in self._deferred_groups():
            settle = getattr(group, "settle", None)
            if settle is not None and settle():
                settled = True
        return settled

    # ------------------------------------------------------------------ direct path
    def _plan(self, scope: str) -> Direct | None:
        """How a host sum over ``scope`` is one MPI allreduce (None: it takes another route).

        Other routes are the hierarchical forms and a gloo backend. The plan's ``comm`` is
        None when the scope holds this rank alone; its ``what`` None when the deadline's
        message names the tensor, as the general path's does.
        """
        intra = self.intra
        if self.host_link is not None and self.host_link.kind == "cpu" and (
                scope == "inter" or (scope == "auto" and self.local_size == 1)):
            return None  # host tensors cross nodes through the link (the CPU tests' gloo)
        # Only MPIIntra's own allreduce_ is known to be that one call.
        mpi_intra = getattr(type(intra), "allreduce_", None) is MPIIntra.allreduce_
        if scope == "flat" or (scope == "auto" and not self.hierarchical and self.num_nodes > 1):
            if self.world.Get_size() == 1:
                return Direct(None, None, None, False)
            return Direct(self.world, None, None, False)
        if scope in ("auto", "intra") and (scope == "intra" or not self.hierarchical):
            if self.local_size == 1:
                return Direct(None, None, None, False)
            if mpi_intra:
                return Direct(intra.comm, "intra-node allreduce (mpi)", intra.world_ranks,
                               False)
            return None
        if scope == "inter":
            if self.num_nodes == 1:
                return Direct(None, None, None, True)
            if self.local_size == 1:
                return Direct(self.inter, None, self.inter_ranks, True)
        return None

    def direct_sum_(self, t: torch.Tensor, scope: ReduceScope = "flat") -> bool:
        """Sum ``t`` over ``scope`` in one guarded MPI allreduce, if that is its whole route.

        That is a contiguous host tensor of an MPI type (not requiring grad), no larger than
        a bucket, on a scope :meth:`_plan` reduces with one MPI call. The call, its deadline
        and its error message are those of the general path (:meth:`world_sum_`,
        :meth:`intra_sum_`, :meth:`inter_sum_`), without the dispatch around them: a few
        checks and one dictionary look-up (what a tensor's address, length and dtype allow
        is kept, with its NumPy view; see :class:`Direct`).

        Returns:
            Whether ``t`` was summed; False leaves it untouched for the general path.
        """
        try:
            plan = self._plans[scope]
        except KeyError:
            plan = self._plan(scope)
            if plan is not None:
                plan.in_place, plan.op = self._mpi or self._mpi_init()
            self._plans[scope] = plan  # complete before another thread can see it
        if plan is None or not t.is_cpu or t.requires_grad or not t.is_contiguous():
            return False
        key = (t.data_ptr(), t.nbytes, t.dtype)
        entry = plan.get(key)
        if entry is None:
            entry = plan.entry(key, self.bucket_bytes)
        if entry is False or entry is True:
            return entry  # not direct / this rank alone: already the sum
        allreduce, in_place, view, op, what, group = entry
        watchdog = self.watchdog
        watchdog.arm(what, group)
        try:
            allreduce(in_place, view, op)
        finally:
            watchdog.disarm()
        return True

    def _mpi_init(self) -> tuple[Any, Any]:
        self._mpi = mpi_consts()
        return self._mpi

    # ------------------------------------------------------------------ MPI helpers
    def _mpi_allreduce_(self, comm: Any, t: torch.Tensor, what: str,
                        group: list[int] | None) -> None:
        """In-place MPI sum of ``t`` over ``comm``, staging device memory when needed."""
        if comm.Get_size() == 1:
            return
        in_place, op_sum = self._mpi or self._mpi_init()

        def op(buf: torch.Tensor) -> None:
            with self.watchdog.guard(what, group):
                comm.Allreduce(in_place, buf.numpy(), op_sum)

        if not t.is_cuda:
            op(t)
        elif self.cuda_aware and t.dtype in MPI_NATIVE:
            wait_device(t.device)  # MPI reads device memory outside any stream's order
            with self.watchdog.guard(what, group):
                comm.Allreduce(in_place, t, op_sum)
        else:
            self.stager.run_staged(t, op)

    def _scratch_for(self, t: torch.Tensor, numel: int, slot: int) -> torch.Tensor:
        key = (t.dtype, t.device, slot)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = zeros(numel, t.dtype, t.device)
            self._scratch[key] = buf
        return buf[:numel]

    # ------------------------------------------------------------------ sums
    def world_sum_(self, t: torch.Tensor, path: ReducePath = "auto") -> None:
        """Sum the 1-D ``t`` over all learners in place."""
        if self._staged(t, lambda h: self.world_sum_(h, path)):
            return
        if path != "flat" and self.local_size == 1 and self.num_nodes > 1 and self._linked(t):
            self._buckets(t, self._inter_leg_)  # super-learners of one: the world is ``inter``
            return
        if path == "flat" or (path == "auto" and not self.hierarchical):
            if self.num_nodes == 1 and path == "auto":
                self._buckets(t, self.intra_sum_)  # one node: the fast intra path only
            else:
                self._buckets(t, lambda b: self._mpi_allreduce_(
                    self.world, b, f"allreduce of {b.numel()} {b.dtype}", None))
            return
        self._buckets(t, self._hier_bucket)

    def intra_sum_(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the learners of this node."""
        if self.local_size == 1 or self._staged(t, self.intra_sum_):
            return
        self._backend(t).allreduce_(t)

    def intra_bcast_(self, t: torch.Tensor, root: int = 0) -> None:
        """Copy local rank ``root``'s ``t`` to every learner of this node."""
        if self.local_size == 1 or self._staged(t, lambda h: self.intra_bcast_(h, root)):
            return
        self._backend(t).bcast_(t, root)

    def inter_sum_(self, t: torch.Tensor) -> None:
        """Sum ``t`` across nodes, assuming it is identical on the learners of each node.

        That is the case for a super-learner's model: each local rank carries one shard, then
        the node allgathers the shards, so every learner ends with the same bits.
        """
        if self.num_nodes == 1 or self._staged(t, self.inter_sum_):
            return
        self._buckets(t, self._inter_bucket)

    def _inter_leg_(self, t: torch.Tensor, what: str | None = None) -> None:
        """Sum ``t`` over ``inter``: through the host link where it takes ``t``, else MPI."""
        what = what or f"inter-node allreduce of {t.numel()} {t.dtype}"
        if self._linked(t):
            self.host_link.allreduce_(t, what, self._mpi_allreduce_)  # type: ignore[union-attr]
        else:
            self._mpi_allreduce_(self.inter, t, what, self.inter_ranks)

    # ------------------------------------------------------------------ per bucket
    def _buckets(self, t: torch.Tensor, fn: Any) -> None:
        n, step = t.numel(), max(1, self.bucket_bytes // t.element_size())
        if n <= step:
            fn(t)
            return
        for lo in range(0, n, step):
            fn(t[lo:lo + step])

    def _padded(self, b: torch.Tensor) -> tuple[torch.Tensor, int]:
        ls = self.local_size
        shard = -(-b.numel() // ls)
        if shard * ls == b.numel():
            return b, shard
        padded = self._scratch_for(b, shard * ls, slot=0)
        padded[:b.numel()].copy_(b)
        padded[b.numel():].zero_()
        return padded, shard

    def _hier_bucket(self, b: torch.Tensor) -> None:
        intra = self._backend(b)
        what = f"inter-node allreduce of {b.numel()} {b.dtype}"
        if self.algo == "shard":
            shard_sum_(intra, b, lambda mine: self._inter_leg_(mine, what),
                       lambda numel, slot: self._scratch_for(b, numel, slot))
        else:
            intra.reduce_(b, root=0)
            if intra.rank == 0:
                self._inter_leg_(b, what)
            intra.bcast_(b, root=0)

    def _inter_bucket(self, b: torch.Tensor) -> None:
        intra = self._backend(b)
        what = f"inter-node allreduce of {b.numel()} {b.dtype}"
        if self.algo == "shard" and self.local_size > 1:
            padded, shard = self._padded(b)
            mine = self._scratch_for(b, shard, slot=1)
            lo = intra.rank * shard
            mine.copy_(padded[lo:lo + shard])
            self._inter_leg_(mine, what)
            intra.allgather_(mine, padded)
            if padded.data_ptr() != b.data_ptr():
                b.copy_(padded[:b.numel()])
        else:
            if intra.rank == 0:
                self._inter_leg_(b, what)
            if self.local_size > 1:
                intra.bcast_(b, root=0)


__all__ = ["HierAlgo", "ReducePath", "ReduceScope", "Reducer", "Route", "device_direct",
           "route"]
