"""A compressed cross-node mean: two stages of exchanged shards, with error feedback.

:class:`CompressedMean` is a compressed allreduce in two stages, reduce-scatter and
allgather (as in 1-bit Adam): each node encodes its tensor in N shards and sends shard k to
node k (all-to-all); node k decodes the N versions of its shard, averages them in node
order, encodes the result with a residual of its own, and every node gathers all shards
(allgather). Every rank decodes the same bytes the same way, so the result is bit-identical
on every rank; a rank sends 2 (N - 1) / N times the payload of the tensor, like a ring
allreduce, so int8 moves ~4x fewer bytes than fp32 for any number of nodes N. The wire
formats and error feedback are :mod:`hadpsgd.comm.codec`'s.

Sparse messages (``topk``) cannot be summed on the wire, and this design never does: node k
decodes its shard's N top-k versions to dense values, averages them densely, and re-encodes
the mean as a top-k of the same fixed size (what the union of the N supports loses beyond k
a chunk stays in node k's server residual, sent in a later round). So a rank receives
exactly what it sends, 2 (N - 1) / N of the tensor's top-k payload, ~141x below fp32's share
at 1/64, and that does not grow with N; an allgather of every node's sparse message instead
would receive (N - 1) whole payloads, growing linearly with N.

:class:`HierarchicalHalfMean` is ``--grad-wire bf16`` across nodes: the world's mean of a
gradient bucket with the node's sum made in full precision inside the node and only the
inter-node leg a :class:`CompressedMean` in bfloat16.
"""

from __future__ import annotations

from typing import Any

import torch

from hadpsgd.comm.backends import IntraBackend
from hadpsgd.comm.codec import check_wire, decode_rows, encode_rows, reinterpret
from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.flat import zeros
from hadpsgd.comm.staging import Stager

MEAN_BUCKET_ELEMS = 1 << 22
"""Elements a :class:`CompressedMean` exchanges per round of collectives: bounds its scratch
memory and keeps every MPI count far below 2**31 bytes (fp64 as is: 32 MiB a bucket)."""


class CompressedMean:
    """Mean across nodes of a flat tensor identical on each node's learners, sent compressed.

    Nodes are super-learners; the wire format rounds with error feedback; the result is
    bit-identical on every rank of the job.

    Who talks: only the communicators given, which must be private to this object's thread
    (duplicates the main thread does not use), so :meth:`mean_` may run in a background
    thread (under MPI_THREAD_MULTIPLE) beside the main thread's collectives. Without
    ``intra`` every local rank exchanges the *whole* tensor with its counterparts (local
    rank j of every node) over ``inter``, with no intra-node step: the bytes then cross a
    node's link once per local rank (:attr:`bytes_sent` is this rank's share; with one
    learner per node, the BMUF-Adam paper's layout, nothing is repeated). With ``intra``
    local rank j exchanges only the j-th of ``local_size`` slices and the node gathers the
    slices over ``intra``: the link carries each byte once, at the price of an intra-node
    allgather (not counted in :attr:`bytes_sent`, which counts only what crosses nodes) and
    of one more communicator. One call at a time per object (its scratch buffers are its
    own), from whichever thread.

    ``fp32`` takes the same two stages (no rounding, no residuals), so :attr:`bytes_sent`
    counts bytes really sent and the sum runs in node order on every rank; it is not
    bit-identical to MPI's allreduce, whose summation order is MPI's own.

    Error feedback: the worker residual (whole tensor) and the server residual (this node's
    shards) are identical on the learners of a node, so one learner's :meth:`state_dict`
    stands for its node; they differ between nodes (per-node state in a checkpoint).

    Args:
        inter: A private inter-node communicator (rank = node index; nodes of equal size).
        watchdog: The deadline keeper of the thread that calls :meth:`mean_` (the caller's:
            it stops it).
        inter_ranks: World ranks in ``inter``, by node (to name a missing peer).
        numel: Elements of the tensors :meth:`mean_` takes.
        dtype: Their dtype (floating point).
        device: Their device (encoding runs there; MPI gets host copies).
        wire: A wire spec (:func:`~hadpsgd.comm.codec.wire_spec`): a format of
            :data:`~hadpsgd.comm.codec.WIRES`, ``topk`` with its fraction.
        intra: A private intra-node communicator (split the tensor in the node), or None.
        node_ranks: World ranks in ``intra``, by local rank.
        polled: Use non-blocking collectives polled with short sleeps instead of blocking
            ones: in a background thread a blocking call spins a core for as long as the
            link takes, and that core is the one training needs.
        bucket_elems: Elements per round of collectives (see :data:`MEAN_BUCKET_ELEMS`).
        feedback: Carry each exchange's rounding into the next (error feedback). Without it
            (a gradient's mean, as DDP's bf16 compression hook has none) nothing is kept
            between calls, and the tensor may differ between the learners of a node.
    """

    def __init__(self, inter: Any, watchdog: Watchdog, inter_ranks: list[int], numel: int,
                 dtype: torch.dtype, device: torch.device | str, wire: str, *,
                 intra: Any = None, node_ranks: list[int] | None = None, polled: bool = False,
                 bucket_elems: int = MEAN_BUCKET_ELEMS, feedback: bool = True) -> None:
        check_wire(wire)
        if not dtype.is_floating_point:
            raise ValueError(f"a compressed mean needs a floating-point dtype, got {dtype}")
        self.inter, self.watchdog, self.inter_ranks = inter, watchdog, inter_ranks
        self.intra, self.node_ranks = intra, node_ranks
        self.numel, self.dtype, self.device, self.wire = numel, dtype, torch.device(device), wire
        self.num_nodes, self.node = inter.Get_size(), inter.Get_rank()
        self.slices = intra.Get_size() if intra is not None else 1
        self.slice = intra.Get_rank() if intra is not None else 0
        self.bucket_elems = max(1, int(bucket_elems))
        self.elem = torch.empty(0, dtype=dtype).element_size()
        self.bytes_sent = 0
        """Payload bytes this rank sent to other nodes so far."""
        self.bytes_received = 0
        """Payload bytes this rank received from other nodes so far (both stages are
        symmetric: each rank receives as many as it sends)."""
        self.polled = polled
        # Per bucket: its slice of the tensor, its shard length, where its residuals sit.
        self._buckets: list[tuple[int, int, int, int]] = []
        server = 0
        for lo in range(0, numel, self.bucket_elems):
            hi = min(lo + self.bucket_elems, numel)
            shard = -(-(hi - lo) // (self.num_nodes * self.slices))
            self._buckets.append((lo, hi, shard, server))
            server += self.slices * shard
        feedback = feedback and wire != "fp32" and self.num_nodes > 1
        self._worker = torch.zeros(numel if feedback else 0, dtype=dtype, device=self.device)
        self._server = torch.zeros(server if feedback else 0, dtype=dtype, device=self.device)
        self._stager = Stager(pin=self.device.type == "cuda")

    # ------------------------------------------------------------------ the mean
    def mean_(self, t: torch.Tensor) -> torch.Tensor:
        """Replace ``t`` by its mean across nodes, in place, and return it.

        ``t`` must be identical on the learners of each node; the result is bit-identical on
        every rank. A collective over every rank of the job (same order of calls everywhere).
        """
        if t.numel() != self.numel or t.dtype != self.dtype or t.device != self.device \
                or not t.is_contiguous():
            raise ValueError(f"mean_: expected a contiguous tensor of {self.numel} {self.dtype}"
                             f" on {self.device}, got {t.numel()} {t.dtype} on {t.device}")
        if self.num_nodes == 1:
            return t
        flat = t.view(-1)
        for lo, hi, shard, server in self._buckets:
            self._bucket(flat[lo:hi], lo, shard, server)
        return t

    def _mpi(self, what: str, group: list[int] | None, fn: Any, *bufs: torch.Tensor) -> None:
        what = f"compressed mean ({self.wire}) of {self.numel} {self.dtype}: {what}"
        arrays = [b.numpy() for b in bufs]
        if self.polled:
            # The non-blocking twin (MPI_Ialltoall, MPI_Iallgather), polled with short sleeps.
            request = getattr(fn.__self__, "I" + fn.__name__.lower())(*arrays)
            self.watchdog.wait(request, what, group)
            return
        with self.watchdog.guard(what, group):
            fn(*arrays)

    def _bucket(self, seg: torch.Tensor, lo: int, shard: int, server: int) -> None:
        n, nodes, feedback = seg.numel(), self.num_nodes, self._worker.numel() > 0
        rows = self.slices * nodes
        x = torch.zeros(rows * shard, dtype=self.dtype, device=self.device)
        x[:n] = seg
        mine = slice(self.slice * nodes, (self.slice + 1) * nodes)  # this rank's slice
        if feedback:
            worker = self._worker[lo:lo + n]
            x[:n].add_(worker)
            payload = encode_rows(x.view(rows, shard), self.wire)
            # Every learner of a node encodes the whole tensor (cheap, no messages), so the
            # worker residual is the same on all of them, whichever slice each one sends.
            sent = decode_rows(payload, shard, self.wire, self.dtype).reshape(-1)[:n]
            _residual(worker, x[:n], sent)
            payload = payload[mine]
        else:
            payload = encode_rows(x.view(rows, shard)[mine], self.wire)
        size = payload.shape[1]
        on_gpu = self.device.type == "cuda"  # pinned host copies only for device tensors
        send = self._stager.buffer(torch.uint8, nodes * size, slot=0, device_copy=on_gpu)
        recv = self._stager.buffer(torch.uint8, nodes * size, slot=1, device_copy=on_gpu)
        send.copy_(payload.reshape(-1))
        self._mpi("all-to-all", self.inter_ranks, self.inter.Alltoall, send, recv)
        versions = decode_rows(recv.view(nodes, size).to(self.device), shard, self.wire,
                               self.dtype)
        mean = versions[0].clone()
        for k in range(1, nodes):  # in node order: the same bits on every node
            mean.add_(versions[k])
        mean.div_(nodes)
        if feedback:
            residual = self._server[server:server + self.slices * shard].view(self.slices, shard)
            mean.add_(residual[self.slice])
            out = encode_rows(mean.view(1, shard), self.wire)
            _residual(residual[self.slice], mean,
                      decode_rows(out, shard, self.wire, self.dtype)[0])
        else:
            out = encode_rows(mean.view(1, shard), self.wire)
        self.bytes_sent += 2 * (nodes - 1) * size
        self.bytes_received += 2 * (nodes - 1) * size  # N - 1 shards in, in either stage
        # A split node also passes on its slice's server residual (see below).
        extra = shard * self.elem if feedback and self.slices > 1 else 0
        record = self._stager.buffer(torch.uint8, nodes * size + extra, slot=2,
                                     device_copy=on_gpu)
        # The encoded mean off the device through a page-locked buffer kept for it (a
        # .cpu() copy was pageable: staged by the driver, and a new allocation each bucket).
        mine_out = out.reshape(-1)
        if on_gpu:
            mine_out = self._stager.buffer(torch.uint8, out.numel(), slot=4).copy_(mine_out)
        self._mpi("allgather", self.inter_ranks, self.inter.Allgather, mine_out,
                  record[:nodes * size])
        if self.slices > 1:
            if feedback:  # the node's learners keep every slice's server residual
                record[nodes * size:].copy_(residual[self.slice].view(torch.uint8))
            node = self._stager.buffer(torch.uint8, self.slices * record.numel(), slot=3,
                                       device_copy=on_gpu)
            self._mpi("intra-node allgather", self.node_ranks, self.intra.Allgather, record,
                      node)
            node = node.view(self.slices, -1).to(self.device)
            if feedback:
                residual.copy_(reinterpret(node[:, nodes * size:], self.dtype))
            record = node[:, :nodes * size]
        result = decode_rows(record.reshape(rows, size).to(self.device), shard, self.wire,
                             self.dtype)
        seg.copy_(result.reshape(-1)[:n])

    def move_worker_residual_(self, into: torch.Tensor, keep: float = 1.0) -> None:
        """Add the worker residual (``keep`` of it) to ``into``; what is added leaves it.

        For a caller that keeps its own rounding error (BMUF's ``--bmuf-residual model``: in
        the worker's model, whose next delta then carries it). Identical on the learners of
        a node, as the residual is. Nothing without error feedback. ``keep`` < 1 moves that
        share and leaves the rest as error feedback.
        """
        if self._worker.numel():
            if keep == 1.0:
                into.add_(self._worker.view_as(into))
                self._worker.zero_()
            else:
                into.add_(self._worker.view_as(into), alpha=keep)
                self._worker.mul_(1.0 - keep)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The error-feedback residuals (host copies) and the layout they belong to."""
        return {"wire": self.wire, "numel": self.numel, "layout": self._layout(),
                "worker": self._worker.cpu().clone(), "server": self._server.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same wire, size, nodes and learners per node).

        Raises:
            ValueError: If the saved residuals belong to another wire or layout.
        """
        saved = (state.get("wire"), state.get("numel"), list(state.get("layout", ())))
        if saved != (self.wire, self.numel, self._layout()):
            raise ValueError(f"compressed-mean state of wire/numel/layout {saved} does not fit "
                             f"{(self.wire, self.numel, self._layout())} (nodes, slices, "
                             "bucket): resume with the same --wire (and --topk-fraction) and "
                             "layout")
        self._worker.copy_(state["worker"])
        self._server.copy_(state["server"])

    def _layout(self) -> list[int]:
        return [self.num_nodes, self.slices, self.bucket_elems]


class HierarchicalHalfMean:
    """The world's mean of a flat tensor, in fp32 inside each node and bf16 between nodes.

    ``--grad-wire bf16`` where the learners span several nodes. Inside a node the learners
    share a fast link (NVLink, shared memory), so the node's sum is made there in full
    precision by the intra-node backend given to :meth:`mean_` (NCCL for device tensors, MPI
    or gloo for host ones); only the leg between nodes, where the NIC is the narrow part,
    carries bfloat16. ``shard`` (nodes of equal size, the hierarchy's default): a
    reduce-scatter leaves slice *j* of the node's sum on local rank *j*, which carries it
    across the nodes (over ``inter``: local rank *j* of every node) as a
    :class:`CompressedMean` without feedback, and an allgather gives the node every slice,
    as :class:`~hadpsgd.comm.side.SideChannel` splits BMUF's block sync. ``leader`` (nodes of
    any size): local rank 0 gets the node's sum, carries all of it and broadcasts the result.
    The node's sum is divided by ``size / num_nodes`` first (its mean, for equal nodes), so
    that the mean across nodes is the world's.

    Each element is then: the node means in fp32, each rounded to bfloat16, summed in node
    order in fp32, divided by the number of nodes and rounded to bfloat16 once more. The
    inter-node mean is the same bits on every node and the node copies it, so every rank
    holds the same bits. :attr:`bytes_sent` counts only what a rank sent between nodes:
    2 (N - 1) / N of its slice in bfloat16 (N nodes), half of a ring's share of that slice
    in fp32, which is what the fp32 hierarchical allreduce sends; the fp32 legs inside the
    node are not counted. One call at a time (the scratch buffers are shared).

    Args:
        inter: The inter-node communicator (local rank *j* of every node, rank = node).
        watchdog: The deadline keeper of the calling thread.
        inter_ranks: World ranks in ``inter``, by node (to name a missing peer).
        size: Learners in the world.
        num_nodes: Nodes in the world.
        shard: The ``shard`` form (needs nodes of equal size), else ``leader``.
    """

    def __init__(self, inter: Any, watchdog: Watchdog, inter_ranks: list[int], *, size: int,
                 num_nodes: int, shard: bool) -> None:
        self.inter, self.watchdog, self.inter_ranks = inter, watchdog, inter_ranks
        self.scale = size / num_nodes
        self.shard = shard
        self.bytes_sent = 0
        """Payload bytes this rank sent to other nodes so far."""
        self._means: dict[tuple[int, torch.dtype, torch.device], CompressedMean] = {}
        self._scratch: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def mean_(self, t: torch.Tensor, intra: IntraBackend) -> int:
        """Replace the contiguous ``t`` by the world's mean, in place; a collective of all.

        Args:
            t: This learner's tensor (a type ``intra`` reduces, on a device it can read).
            intra: The node's backend for ``t`` (the reducer's choice for its device).

        Returns:
            The payload bytes this rank sent to other nodes in this call.
        """
        flat, before = t.view(-1), self.bytes_sent
        alone = intra.size == 1
        if self.shard and not alone:
            n, parts = flat.numel(), intra.size
            piece = -(-n // parts)
            padded = flat if piece * parts == n else self._buffer(flat, piece * parts, 0)
            if padded is not flat:  # the reduce-scatter needs equal slices: pad with zeros
                padded[:n].copy_(flat)
                padded[n:].zero_()
            mine = self._buffer(flat, piece, 1)
            intra.reduce_scatter_(padded, mine)
            self._across(mine.div_(self.scale))
            intra.allgather_(mine, padded)
            if padded is not flat:
                flat.copy_(padded[:n])
        else:
            if not alone:
                intra.reduce_(flat, root=0)
            if intra.rank == 0:
                self._across(flat.div_(self.scale))
            if not alone:
                intra.bcast_(flat, root=0)
        return self.bytes_sent - before

    def _across(self, part: torch.Tensor) -> None:
        """The mean of ``part`` across the nodes, bf16 on the wire (one object per size)."""
        key = (part.numel(), part.dtype, part.device)
        mean = self._means.get(key)
        if mean is None:
            mean = self._means[key] = CompressedMean(
                self.inter, self.watchdog, self.inter_ranks, part.numel(), part.dtype,
                part.device, "bf16", feedback=False)
        before = mean.bytes_sent
        mean.mean_(part)
        self.bytes_sent += mean.bytes_sent - before

    def _buffer(self, like: torch.Tensor, numel: int, slot: int) -> torch.Tensor:
        """Scratch ``slot`` of ``like``'s dtype and device, grown to the largest bucket."""
        key = (slot, like.dtype, like.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = zeros(numel, like.dtype, like.device)
        return buf[:numel]


def half_mean_in_(means: dict[tuple[str, int, str], CompressedMean], scope: str, comm: Any,
                  watchdog: Watchdog, ranks: list[int], tensor: torch.Tensor) -> int:
    """The mean of ``tensor`` over ``comm`` (one node, or a world of one) with bf16 shards.

    ``--grad-wire bf16`` inside one node, for either world: each learner's tensor rounded to
    bfloat16 and sent in shards (all-to-all), each shard's versions summed in fp32 in rank
    order, rounded once more and gathered by every learner, no residual kept between calls.
    The :class:`CompressedMean` of each scope and size is made once and kept in ``means``.

    Returns:
        The payload bytes this learner sent (0 alone in ``comm``).
    """
    if comm.Get_size() == 1:
        return 0
    key = (scope, tensor.numel(), str(tensor.device))
    mean = means.get(key)
    if mean is None:
        mean = means[key] = CompressedMean(comm, watchdog, ranks, tensor.numel(), tensor.dtype,
                                           tensor.device, "bf16", feedback=False)
    before = mean.bytes_sent
    mean.mean_(tensor)
    return mean.bytes_sent - before


def _residual(out: torch.Tensor, x: torch.Tensor, sent: torch.Tensor) -> None:
    """``out = x - sent``, the error carried to the next exchange.

    A non-finite value's residual is dropped (0): carried on, it would make that chunk
    non-finite in every later exchange, even once the input is finite again.
    """
    torch.sub(x, sent, out=out)
    out.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


__all__ = ["MEAN_BUCKET_ELEMS", "CompressedMean", "HierarchicalHalfMean", "half_mean_in_"]
