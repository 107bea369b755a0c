"""Topology discovery and the collectives on flat tensors (contract: ``hadpsgd.comm``).

The channels a topology makes after start-up (pair, side, pipeline, counters) are
:mod:`hadpsgd.comm.channels`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hadpsgd.comm.backends import IntraBackend
from hadpsgd.comm.channels import Channels
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.hierarchical import ReducePath, Reducer, Route
from hadpsgd.comm.mpi import MPI_NATIVE, abort_job
from hadpsgd.comm.objects import (
    allgather_object,
    bcast_object,
    every_rank_failed,
    gather_object,
)
from hadpsgd.comm.pair import PairChannel
from hadpsgd.comm.staging import wait_device
from hadpsgd.comm.ulfm import raise_if_revoked
from hadpsgd.comm.world import ReduceOp


class TopologyError(ValueError):
    """A process layout that cannot work (bad ``ranks_per_node``, unequal nodes, ...).

    Attributes:
        uniform: Whether every rank finds it alike (a layout, a flag, an environment
            variable): then rank 0 says it once (``hadpsgd.run``). False where it is this
            rank's own (its device).
    """

    def __init__(self, message: str, uniform: bool = True) -> None:
        super().__init__(message)
        self.uniform = uniform


@dataclass
class Topology(Channels):
    """Where this learner sits and how it talks to the others.

    Attributes:
        comm: The world communicator (all learners).
        intra: Communicator of the learners on this (possibly emulated) node.
        inter: Communicator of the learners with the same ``local_rank`` across nodes.
        rank: Rank in ``comm``.
        size: Number of learners.
        local_rank: Rank inside the node.
        local_size: Learners on this node.
        node: Index of this node (super-learner).
        num_nodes: Number of nodes (super-learners).
        node_sizes: Learners per node, by node index.
        emulated: True when nodes are emulated by ``ranks_per_node``.
        device: The torch device this learner computes on.
        timeout: Deadline in seconds of every blocking wait.
        thread_level: MPI thread level granted.
        intra_backend: Name of the intra-node backend of this learner's device tensors
            (``mpi``, ``gloo`` or ``nccl``; host tensors always take ``mpi`` or ``gloo``).
        cuda_aware: Whether the MPI library accepts device buffers.
        node_ranks: World ranks of this node's learners, by local rank.
        inter_ranks: World ranks in ``inter``, by node.
        host_rank: Rank among the processes on this physical host (binds the GPU).
        host_size: Processes on this physical host.
        placement: Every rank's host and device, one line (see ``placement.summarize``).
        hosts: Every rank's host name, by world rank.
        notes: Why the backends are what they are (fall-backs and how to get the fast path).
    """

    comm: Any
    intra: Any
    inter: Any
    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    node_sizes: list[int]
    emulated: bool
    device: torch.device
    timeout: float
    thread_level: int
    intra_backend: str
    cuda_aware: bool
    node_ranks: list[int]
    inter_ranks: list[int]
    watchdog: Watchdog = field(repr=False)
    reducer: Reducer = field(repr=False)
    _backend: IntraBackend = field(repr=False)
    _mpi: Any = field(repr=False, default=None)
    host_rank: int = 0
    host_size: int = 1
    placement: str = ""
    hosts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _pairs: PairChannel | None = field(repr=False, default=None)
    _half_means: dict[tuple[str, int, str], Any] = field(repr=False, default_factory=dict)
    _hier_half: Any = field(repr=False, default=None)
    launch_ranks: list[int] = field(default_factory=list)
    """Every rank's rank at launch (``MPI.COMM_WORLD``), by rank: the same list until the
    survivors of a failure renumber themselves (``hadpsgd.comm.ulfm``)."""
    _tracked: list[Any] = field(repr=False, default_factory=list)
    """Communicators made after start-up (channels, counters): revoked with the rest."""
    _links: list[Any] = field(repr=False, default_factory=list)
    """Host links of the pair and side channels (their NCCL groups), released by
    :meth:`close`."""
    _errors: Any = field(repr=False, default=None)
    """A communicator for :meth:`every_rank_failed` and the notes about a frozen learner
    (``hadpsgd.comm.ulfm``): nothing else waits on it, and a failure does not revoke it."""
    pids: list[int] = field(default_factory=list)
    """Every rank's process id, by rank (on its host, :attr:`hosts`)."""

    # ------------------------------------------------------------------ layout
    @property
    def thread_multiple(self) -> bool:
        """Whether MPI granted MPI_THREAD_MULTIPLE (needed by a background comm thread)."""
        return self._mpi is not None and self.thread_level >= self._mpi.THREAD_MULTIPLE

    @property
    def equal_nodes(self) -> bool:
        """Whether every node holds the same number of learners."""
        return len(set(self.node_sizes)) == 1

    def require_equal_nodes(self, what: str) -> None:
        """Raise a :class:`TopologyError` naming ``what`` if node sizes differ."""
        if not self.equal_nodes:
            raise TopologyError(
                f"{what} needs nodes of equal size, but the {self.size} ranks form nodes of "
                f"sizes {self.node_sizes}; launch a multiple of --ranks-per-node ranks"
            )

    def describe(self) -> str:
        """One line for the start-up log."""
        kind = "emulated " if self.emulated else ""
        path = self.route(torch.empty(0, device=self.device))
        if self.device.type != "cuda":
            inter = "host buffers"
        else:
            inter = ("CUDA-aware" if self.cuda_aware
                     else "not CUDA-aware: staged through pinned host buffers")
        cross = f"MPI ({inter})"
        link = self.reducer.host_link
        if link is not None and link.kind == self.device.type:
            cross = f"{link.name} between super-learners of one host" + (
                f", MPI ({inter}) between hosts" if link.hosts > 1 else "") + (
                " (each member its shard)" if link.shards is not None else "")
        nodes = f"{kind}node{'s' if self.num_nodes != 1 else ''}"
        line = (f"{self.size} learner{'s' if self.size != 1 else ''} on {self.num_nodes} "
                f"{nodes} {self.node_sizes}, "
                f"device {self.device}, intra-node {path.intra} (host tensors: "
                f"{self.reducer.intra.name}), inter-node {cross}, {self.reducer.algo} "
                f"hierarchy, deadline {self.timeout:g} s")
        sites = self.sites()
        if sites:
            line += (f"; each node spans {sites} hosts: a site, with its mean inside it "
                     "and the algorithm between sites")
        groups = self.torch_groups()
        if groups:
            kinds = sorted({kind for kind, _ in groups})
            took = self.torch_group_bytes()
            line += (f"; {len(groups)} torch.distributed group{'s' if len(groups) != 1 else ''}"
                     f" on this rank ({', '.join(kinds)}: "
                     f"{', '.join(what for _, what in groups)}"
                     + (f"; {took / 2**30:.2f} GiB of device memory at set-up"
                        if took is not None else "") + ")")
        if self.placement:
            line += f"; ranks: {self.placement}"
        return line

    def torch_groups(self) -> list[tuple[str, str]]:
        """The torch.distributed groups this rank holds now (NCCL communicators on GPUs).

        Each NCCL communicator takes device memory of its own (0.5-1.6 GB with NVLink
        SHARP), so the start-up line counts them: (backend, what it carries) pairs. Only
        the main thread launches on them (comm/hostlink.py: *One thread launches NCCL*).
        """
        return [(backend.name, what) for backend, what in self._torch_backends()]

    def torch_group_bytes(self) -> int | None:
        """Device memory this rank's NCCL communicators took when made, or None (none made).

        The sum of each one's fall in the GPU's free memory across its set-up
        (:attr:`~hadpsgd.comm.nccl.NCCLIntra.device_bytes`): NCCL's own buffers, which
        torch's allocator neither holds nor reports. Where ranks share one GPU
        (``HADPSGD_SHARE_GPU``) their set-ups overlap and each figure may hold a
        neighbour's too.
        """
        sizes = [getattr(backend, "device_bytes", None) for backend, _ in self._torch_backends()]
        known = [int(b) for b in sizes if b is not None]
        return sum(known) if known else None

    def _torch_backends(self) -> list[tuple[Any, str]]:
        """Each torch.distributed backend of this rank once, with what it carries."""
        found: list[tuple[Any, str]] = []
        seen: set[int] = set()
        r = self.reducer
        candidates = [(r.intra, "node"), (r.device_intra, "node's device tensors")]
        links = [r.host_link, *self._links]
        candidates += [(link.local, "host link" if i == 0 else "a channel's host link")
                       for i, link in enumerate(links) if link is not None]
        for backend, what in candidates:
            if backend is None or getattr(backend, "pg", None) is None or id(backend) in seen:
                continue
            seen.add(id(backend))
            found.append((backend, what))
        return found

    def sites(self) -> str | None:
        """Hosts per super-learner where emulated nodes span several hosts, else None.

        ``--ranks-per-node`` larger than a host's ranks makes each super-learner a *site*:
        its learners average every step across its hosts (the intra-node path, over the
        site's own network), and the algorithm's exchanges cross between sites.
        """
        if not self.emulated or len(self.hosts) != self.size:
            return None
        counts, at = [], 0
        for n in self.node_sizes:
            counts.append(len(set(self.hosts[at:at + n])))
            at += n
        if max(counts) <= 1:
            return None
        return str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))

    def route(self, tensor: torch.Tensor) -> Route:
        """The path ``tensor`` takes in :meth:`allreduce_` and its relatives."""
        return self.reducer.route(tensor)

    # ------------------------------------------------------------------ activity
    @contextlib.contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """Say ``what`` this rank is doing for the length of a ``with`` block.

        A peer whose collective times out asks the others what they are doing; a rank that
        is alive but outside communication (a checkpoint write, a slow batch) answers with
        this. The previous activity is back on exit, so blocks nest.
        """
        before = self.watchdog.activity
        self.watchdog.activity = what
        try:
            yield
        finally:
            self.watchdog.activity = before

    def now_doing(self, what: str) -> None:
        """Say ``what`` this rank is doing from now on (where no ``with`` block fits)."""
        self.watchdog.activity = what

    @contextlib.contextmanager
    def startup(self, phase: str) -> Iterator[None]:
        """Name the start-up ``phase`` this rank is in for the length of a ``with`` block.

        A deadline that passes in it names the phase (``rank 0 (start-up: data checks):
        ...``) and a stuck peer that asks is told ``starting up: <phase>``. Under
        ``--on-failure continue`` a frozen learner found in start-up ends the job: there is
        no trained state yet to go on from. Blocks nest; the previous phase is back on exit.
        """
        watchdog = self.watchdog
        before = watchdog.phase, watchdog.activity
        watchdog.phase, watchdog.activity = phase, f"starting up: {phase}"
        try:
            yield
        finally:
            watchdog.phase, watchdog.activity = before

    # ------------------------------------------------------------------ collectives
    def _reduce(self, tensor: torch.Tensor, op: ReduceOp, fn: Any, count: int) -> torch.Tensor:
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        # The reducer stages what its backends cannot take (half precision for MPI, device
        # memory without NCCL); only a non-contiguous tensor needs a copy here.
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        fn(work.view(-1))
        if op == "avg" and count > 1:
            work.div_(count)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg",
                   path: ReducePath = "auto") -> torch.Tensor:
        """Reduce ``tensor`` in place over all learners (``avg`` or ``sum``) and return it.

        Args:
            tensor: Any contiguous tensor (flat buffers make one message per bucket).
            op: ``avg`` or ``sum``.
            path: ``hier`` (intra-node reduce, inter-node allreduce, intra-node copy-out),
                ``flat`` (one MPI allreduce over the world) or ``auto`` (hierarchical when
                there are several nodes with several learners).
        """
        if (op == "sum" or op == "avg") and self.reducer.direct_sum_(tensor, path):
            if op == "avg" and self.size > 1:
                tensor.div_(self.size)
            return tensor
        return self._reduce(tensor, op, lambda t: self.reducer.world_sum_(t, path), self.size)

    def mean_deferred_(self, tensor: torch.Tensor, scope: str) -> bool:
        """Start averaging the contiguous device ``tensor`` over ``scope`` without waiting.

        ``scope`` is ``world`` or ``node``. Where the whole route is one NCCL allreduce it
        runs on NCCL's stream while this stream goes on (backward's kernels are not held
        up), ``tensor`` holds the mean after :meth:`join_deferred`, and the result is True.
        Otherwise nothing is done (False): use :meth:`allreduce_` / :meth:`intra_allreduce_`.
        """
        return self.reducer.mean_deferred_(tensor, "intra" if scope == "node" else scope)

    def deferrable(self, scope: str) -> bool:
        """Whether :meth:`mean_deferred_` would take a device tensor over ``scope``."""
        return self.reducer.deferrable("intra" if scope == "node" else scope)

    def half_mean_(self, tensor: torch.Tensor, scope: str) -> int:
        """Average the contiguous fp32 ``tensor`` over ``scope`` with bf16 on the wire.

        ``scope`` is ``world`` or ``node``. Where the scope spans several nodes (``world``),
        only the inter-node leg is bf16: the node's sum is made in fp32 by the intra-node
        backend (NCCL on GPUs, MPI's shared memory or gloo on host), local rank *j* carries
        slice *j* of it across the nodes in bf16 and the node shares the result
        (:class:`~hadpsgd.comm.compressed.HierarchicalHalfMean`). Inside one node (``node``,
        or a world of one node) each learner's tensor is rounded to bfloat16 and sent in
        shards (all-to-all), each shard's versions are summed in fp32 in rank order, rounded
        to bfloat16 once more and gathered by every learner (allgather). Either way no
        residual is kept between calls (as DDP's bf16 compression hook) and every learner of
        the scope holds the same bits. Device tensors are coded on the device and staged
        through pinned host memory where MPI cannot read them. (Where NCCL carries the whole
        scope, use :meth:`mean_deferred_` on a bf16 copy: NCCL reduces bfloat16 itself.)

        Returns:
            The payload bytes this rank sent: across several nodes only those it sent to
            other nodes (half of the fp32 hierarchical allreduce's), inside one node those
            it sent to the node's learners (half of an fp32 ring's share).
        """
        from hadpsgd.comm.compressed import half_mean_in_  # noqa: PLC0415 - --grad-wire only

        if scope not in ("world", "node"):
            raise ValueError(f"scope must be 'world' or 'node', got {scope!r}")
        if scope == "world" and self.num_nodes > 1:
            return self._half_mean_across_(tensor)
        comm, ranks = ((self.comm, list(range(self.size))) if scope == "world"
                       else (self.intra, self.node_ranks))
        return half_mean_in_(self._half_means, scope, comm, self.watchdog, ranks, tensor)

    def _half_mean_across_(self, tensor: torch.Tensor) -> int:
        """:meth:`half_mean_` over the world of several nodes (fp32 inside, bf16 between)."""
        from hadpsgd.comm.compressed import HierarchicalHalfMean  # noqa: PLC0415

        if self._hier_half is None:
            self._hier_half = HierarchicalHalfMean(
                self.inter, self.watchdog, self.inter_ranks, size=self.size,
                num_nodes=self.num_nodes, shard=self.reducer.algo == "shard")
        dev = self.reducer.device_intra
        backend = dev if tensor.is_cuda and dev is not None else self.reducer.intra
        if self.local_size == 1 or not self.route(tensor).intra.endswith("via host"):
            # (A learner alone in its node makes no intra-node call: the inter-node leg
            # codes device tensors on the device and stages only the bf16 payload.)
            return self._hier_half.mean_(tensor, backend)
        # Memory the node's backend cannot take (device tensors of ranks that share a GPU
        # without a CUDA-aware MPI, a dtype MPI lacks): the whole mean on an fp32 host copy,
        # cut as on every other rank (the route is agreed at start-up).
        host = tensor.to("cpu", torch.float32)
        sent = self._hier_half.mean_(host, backend)
        tensor.copy_(host)
        return sent

    def join_deferred(self, host_wait: bool = True) -> None:
        """Wait (stream-wise, then once on the host under the deadline) for deferred means.

        With ``host_wait=False`` only the stream waits: the host wait is owed to
        :meth:`settle_deferred`, which the caller makes after queuing more work (so one host
        wait covers both). Until then nothing on the host may read what the means wrote.
        """
        self.reducer.join_deferred(host_wait)

    def settle_deferred(self) -> bool:
        """Block the host until the joined means are done, under the deadline (if owed).

        The wait covers the work queued after them on the current stream too.

        Returns:
            Whether it waited: False where no wait was owed (nothing was deferred, or the
            join already waited), and the caller must synchronise itself.
        """
        return self.reducer.settle_deferred()

    def intra_allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg") -> torch.Tensor:
        """Reduce ``tensor`` over the learners of this node only (one super-learner)."""
        if (op == "sum" or op == "avg") and self.reducer.direct_sum_(tensor, "intra"):
            if op == "avg" and self.local_size > 1:
                tensor.div_(self.local_size)
            return tensor
        return self._reduce(tensor, op, self.reducer.intra_sum_, self.local_size)

    def inter_allreduce_(self, tensor: torch.Tensor, op: ReduceOp = "avg") -> torch.Tensor:
        """Reduce across nodes a ``tensor`` identical on the learners of each node.

        That is a super-learner's model; ``avg`` divides by the number of nodes.
        """
        if (op == "sum" or op == "avg") and self.reducer.direct_sum_(tensor, "inter"):
            if op == "avg" and self.num_nodes > 1:
                tensor.div_(self.num_nodes)
            return tensor
        return self._reduce(tensor, op, self.reducer.inter_sum_, self.num_nodes)

    def intra_broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on this node's learners with local rank ``root``'s."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.reducer.intra_bcast_(work.view(-1), root)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every learner with ``root``'s and return it.

        Host tensors of MPI's types go as they are, device tensors as they are where MPI is
        CUDA-aware; anything else through the reducer's pinned, pipelined staging.
        """
        if self.size == 1:
            return tensor
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        what = f"broadcast of {tensor.numel()} {tensor.dtype} from rank {root}"

        def bcast(buf: Any) -> None:
            with self.watchdog.guard(what):
                self.comm.Bcast(buf, root=root)

        native = work.dtype in MPI_NATIVE
        if native and not work.is_cuda:
            bcast(work.numpy())
        elif native and self.cuda_aware:
            wait_device(work.device)
            bcast(work)
        else:
            self.reducer.stager.run_staged(work.view(-1), lambda h: bcast(h.numpy()))
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def every_rank_failed(self, message: str, wait_s: float = 3.0) -> list[str] | None:
        """Every learner's error message, if every learner failed before training (bounded).

        Returns:
            The messages by rank; None if some learner did not report an error within
            ``wait_s`` seconds (it went on, or failed elsewhere): then abort as usual.
        """
        if self.size == 1 or self._errors is None:
            return [message]
        return every_rank_failed(self._errors, message, wait_s)

    def check_revoked(self) -> None:
        """Raise MPI's ``ERR_REVOKED`` if a peer revoked the world after a failure (ULFM)."""
        if self.size > 1:
            raise_if_revoked(self.comm)

    def communicators(self) -> list[Any]:
        """Every MPI communicator this learner may wait on: what a failure must revoke."""
        return [self.comm, self.intra, self.inter, self.watchdog.control, *self._tracked]

    def barrier(self) -> None:
        """Wait until every learner arrives (with the deadline)."""
        if self.size > 1:
            self.watchdog.wait(self.comm.Ibarrier(), "barrier")

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root`` (with the deadline) and return it."""
        return bcast_object(self.comm, self.watchdog, obj, root)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Gather a picklable object from every learner onto ``root`` (None elsewhere)."""
        return gather_object(self.comm, self.watchdog, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every learner onto every learner."""
        return allgather_object(self.comm, self.watchdog, obj)

    def abort(self, code: int = 1) -> None:
        """Abort the whole job (every rank), used when an error would otherwise hang peers."""
        abort_job(self.comm, code)

    def close(self) -> None:
        """Release the intra-node backend and stop the watchdog's thread.

        The MPI communicators live until exit.
        """
        self._backend.close()
        if self.reducer.device_intra is not None:
            self.reducer.device_intra.close()
        for link in [self.reducer.host_link, *self._links]:
            if link is not None:
                link.close()
        self.watchdog.stop()
