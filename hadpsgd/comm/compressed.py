"""Compressed wire formats for the inter-node exchanges, and a compressed cross-node mean.

``--wire fp32|bf16|int8`` picks what BMUF's block sync and ADPSGD's gossip put on the
inter-node link: the tensor's own bytes (``fp32``, no compression), bfloat16 (2 bytes a
value), or int8 with one fp32 scale per :data:`INT8_CHUNK` values (~1 byte a value). The
payload is a flat ``uint8`` tensor, so MPI moves it as bytes whatever the dtype.

A compressed format rounds; *error feedback* (1-bit Adam, PowerSGD) carries what one exchange
lost into the next: send ``encode(x + e)``, keep ``e = (x + e) - decode(that)``. Over K
exchanges the decoded values then sum to the inputs' sum minus the last residual, which stays
within one rounding step, so nothing is lost for good.

:class:`CompressedMean` is a compressed allreduce in two stages, reduce-scatter and
allgather (as in 1-bit Adam): each node encodes its tensor in N shards and sends shard k to
node k (all-to-all); node k decodes the N versions of its shard, averages them in node
order, encodes the result with a residual of its own, and every node gathers all shards
(allgather). Every rank decodes the same bytes the same way, so the result is bit-identical
on every rank; a rank sends 2 (N - 1) / N times the payload of the tensor, like a ring
allreduce, so int8 moves ~4x fewer bytes than fp32 for any number of nodes N.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hadpsgd.comm.deadline import Watchdog
from hadpsgd.comm.staging import Stager

WIRES: tuple[str, ...] = ("fp32", "bf16", "int8")
"""Wire formats; ``fp32`` is the tensor's own dtype, uncompressed."""
INT8_CHUNK = 1024
"""Values per int8 scale. A scale costs 4 bytes, so 1024 values carry 4/1024 = 0.4 % of
overhead (int8 stays at 3.98x below fp32), while a chunk is still small enough that one
large value only coarsens the rounding of its own 1023 neighbours, not of a whole layer."""
MEAN_BUCKET_ELEMS = 1 << 22
"""Elements a :class:`CompressedMean` exchanges per round of collectives: bounds its scratch
memory and keeps every MPI count far below 2**31 bytes (fp64 as is: 32 MiB a bucket)."""


def check_wire(wire: str) -> None:
    """Raise ``ValueError`` unless ``wire`` is one of :data:`WIRES`."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")


def payload_bytes(numel: int, wire: str, elem_size: int = 4) -> int:
    """Bytes :func:`encode` makes of ``numel`` values (``elem_size``: the dtype's, for fp32)."""
    check_wire(wire)
    if wire == "fp32":
        return numel * elem_size
    if wire == "bf16":
        return 2 * numel
    return numel + 4 * -(-numel // INT8_CHUNK)


def _view(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes seen as ``dtype`` (a copy where they are not aligned to its size)."""
    if p.shape[-1] == 0:  # torch gives an empty row the stride 1, which no view accepts
        return torch.empty(p.shape, dtype=dtype, device=p.device)
    try:
        return p.view(dtype)
    except RuntimeError:  # a fresh tensor: clone() would keep a size-1 row's odd stride
        return torch.empty(p.shape, dtype=p.dtype, device=p.device).copy_(p).view(dtype)


def _encode_rows(x: torch.Tensor, wire: str) -> torch.Tensor:
    """Encode each row of the 2-D ``x`` on its own: ``[R, m]`` values -> ``[R, P]`` bytes.

    May return a view of ``x`` (fp32). int8 rows are ``[scales (fp32) | values (int8)]``.
    """
    rows, m = x.shape
    if wire == "fp32":
        return x.contiguous().view(torch.uint8)
    if wire == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    chunks = -(-m // INT8_CHUNK)
    blocks = torch.nn.functional.pad(x.to(torch.float32), (0, chunks * INT8_CHUNK - m))
    blocks = blocks.view(rows, chunks, INT8_CHUNK)
    # amax propagates NaN and abs(-inf) = inf: a non-finite chunk gets a non-finite scale, so
    # it decodes to non-finite values and the trainer's finiteness checks still see it.
    scale = blocks.abs().amax(dim=2).div_(127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero chunk: q = 0
    q = blocks.div_(safe.unsqueeze(2)).round_().clamp_(-127, 127).nan_to_num_(0.0)
    out = torch.empty(rows, 4 * chunks + m, dtype=torch.uint8, device=x.device)
    out[:, :4 * chunks] = scale.view(torch.uint8)
    out[:, 4 * chunks:] = q.view(rows, -1)[:, :m].to(torch.int8).view(torch.uint8)
    return out


def _decode_rows(p: torch.Tensor, m: int, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_encode_rows`: ``[R, P]`` bytes -> ``[R, m]`` of ``dtype`` (may alias)."""
    if wire == "fp32":
        return _view(p, dtype)
    if wire == "bf16":
        return _view(p, torch.bfloat16).to(dtype)
    rows, chunks = p.shape[0], -(-m // INT8_CHUNK)
    scale = _view(p[:, :4 * chunks], torch.float32)
    out = torch.zeros(rows, chunks * INT8_CHUNK, dtype=torch.float32, device=p.device)
    out[:, :m] = p[:, 4 * chunks:].view(torch.int8)
    out.view(rows, chunks, INT8_CHUNK).mul_(scale.unsqueeze(2))
    return out[:, :m].to(dtype)


def encode(x: torch.Tensor, wire: str) -> torch.Tensor:
    """A flat float tensor as a new flat ``uint8`` payload of :func:`payload_bytes` bytes.

    ``fp32``: the raw bytes of ``x`` (its own dtype); ``bf16``: ``x`` rounded to bfloat16;
    ``int8``: per chunk of :data:`INT8_CHUNK` values, ``scale = absmax / 127`` (fp32) and
    ``q = round(x / scale)`` (a zero chunk has scale 0; a non-finite one a non-finite scale).
    Computed on ``x``'s device.
    """
    check_wire(wire)
    out = _encode_rows(x.reshape(1, -1), wire).reshape(-1)
    return out.clone() if wire == "fp32" else out


def decode(payload: torch.Tensor, numel: int, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """The ``numel`` values of ``dtype`` an :func:`encode` payload stands for (a new tensor)."""
    check_wire(wire)
    elem = torch.empty(0, dtype=dtype).element_size()
    if payload.numel() != payload_bytes(numel, wire, elem):
        raise ValueError(f"a {wire} payload of {numel} {dtype} values has "
                         f"{payload_bytes(numel, wire, elem)} bytes, got {payload.numel()}")
    out = _decode_rows(payload.reshape(1, -1), numel, wire, dtype).reshape(-1)
    return out.clone() if wire == "fp32" else out


class TopologyLike(Protocol):
    """What :class:`CompressedMean` reads of a :class:`hadpsgd.comm.Topology`.

    A protocol, not the class: importing it here would close an import circle (the topology
    builds compressed means).
    """

    comm: Any
    intra: Any
    inter: Any
    timeout: float
    inter_ranks: list[int]
    node_ranks: list[int]

    @property
    def thread_multiple(self) -> bool: ...  # noqa: D102

    def require_equal_nodes(self, what: str) -> None: ...  # noqa: D102


class CompressedMean:
    """Mean across nodes of a flat tensor identical on each node's learners, sent compressed.

    Nodes are super-learners; the wire format rounds with error feedback; the result is
    bit-identical on every rank of the job.

    Who talks: no call here uses a communicator the main thread uses, so :meth:`mean_` may
    run in a background thread (under MPI_THREAD_MULTIPLE) beside the main thread's
    collectives. By default every local rank exchanges the *whole* tensor with its
    counterparts (local rank j of every node) over its own duplicate of the inter-node
    communicator, with no intra-node step: the bytes then cross a node's link once per local
    rank (:attr:`bytes_sent` is this rank's share; with one learner per node, the BMUF-Adam
    paper's layout, nothing is repeated). With ``split_node`` (or a private ``intra``
    communicator) local rank j exchanges only the j-th of ``local_size`` slices and the node
    gathers the slices over a duplicate of its own communicator: the link carries each byte
    once, at the price of an intra-node allgather (not counted in :attr:`bytes_sent`, which
    counts only what crosses nodes) and of one more communicator. One call at a time per
    object (its scratch buffers are its own), from whichever thread.

    ``fp32`` takes the same two stages (no rounding, no residuals), so :attr:`bytes_sent`
    counts bytes really sent and the sum runs in node order on every rank; it is not
    bit-identical to MPI's allreduce, whose summation order is MPI's own.

    Error feedback: the worker residual (whole tensor) and the server residual (this node's
    shards) are identical on the learners of a node, so one learner's :meth:`state_dict`
    stands for its node; they differ between nodes (per-node state in a checkpoint).

    Args:
        topo: The topology: its inter-node (and, with ``split_node``, intra-node)
            communicator is duplicated and a watchdog made, collectively (every rank of the
            job constructs it). None: give ``comm``, ``watchdog`` and ``inter_ranks``.
        numel: Elements of the tensors :meth:`mean_` takes.
        dtype: Their dtype (floating point).
        device: Their device (encoding runs there; MPI gets host copies).
        wire: One of :data:`WIRES`.
        comm: A private inter-node communicator (rank = node index), instead of ``topo``'s.
        watchdog: The watchdog of ``comm``'s thread.
        inter_ranks: World ranks in ``comm``, by node (to name a missing peer).
        intra: A private intra-node communicator (split the tensor in the node), or None.
        node_ranks: World ranks in ``intra``, by local rank.
        split_node: With ``topo``: duplicate its intra-node communicator as ``intra``.
        bucket_elems: Elements per round of collectives (see :data:`MEAN_BUCKET_ELEMS`).
    """

    def __init__(self, topo: TopologyLike | None, numel: int, dtype: torch.dtype,
                 device: torch.device, wire: str, *, comm: Any = None,
                 watchdog: Watchdog | None = None, inter_ranks: list[int] | None = None,
                 intra: Any = None, node_ranks: list[int] | None = None,
                 split_node: bool = False, bucket_elems: int = MEAN_BUCKET_ELEMS) -> None:
        check_wire(wire)
        if not dtype.is_floating_point:
            raise ValueError(f"a compressed mean needs a floating-point dtype, got {dtype}")
        self._own_watchdog = topo is not None
        if topo is not None:
            topo.require_equal_nodes("a compressed cross-node mean")
            comm, inter_ranks = topo.inter.Dup(), topo.inter_ranks
            watchdog = Watchdog(topo.comm.Dup(), topo.timeout, topo.thread_multiple)
            if split_node:
                intra, node_ranks = topo.intra.Dup(), topo.node_ranks
        if comm is None or watchdog is None or inter_ranks is None:
            raise ValueError("CompressedMean needs a topology, or comm, watchdog and inter_ranks")
        self.comm, self.watchdog, self.inter_ranks = comm, watchdog, inter_ranks
        self.intra, self.node_ranks = intra, node_ranks
        self.numel, self.dtype, self.device, self.wire = numel, dtype, torch.device(device), wire
        self.num_nodes, self.node = comm.Get_size(), comm.Get_rank()
        self.slices = intra.Get_size() if intra is not None else 1
        self.slice = intra.Get_rank() if intra is not None else 0
        self.bucket_elems = max(1, int(bucket_elems))
        self.elem = torch.empty(0, dtype=dtype).element_size()
        self.bytes_sent = 0
        """Payload bytes this rank sent to other nodes so far."""
        self.polled = False
        """Use non-blocking collectives polled with short sleeps instead of blocking ones: in a
        background thread a blocking call spins a core for as long as the link takes, and
        that core is the one training needs (set by :class:`~hadpsgd.comm.side.SideChannel`)."""
        # Per bucket: its slice of the tensor, its shard length, where its residuals sit.
        self._buckets: list[tuple[int, int, int, int]] = []
        server = 0
        for lo in range(0, numel, self.bucket_elems):
            hi = min(lo + self.bucket_elems, numel)
            shard = -(-(hi - lo) // (self.num_nodes * self.slices))
            self._buckets.append((lo, hi, shard, server))
            server += self.slices * shard
        feedback = wire != "fp32" and self.num_nodes > 1
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
            payload = _encode_rows(x.view(rows, shard), self.wire)
            # Every learner of a node encodes the whole tensor (cheap, no messages), so the
            # worker residual is the same on all of them, whichever slice each one sends.
            sent = _decode_rows(payload, shard, self.wire, self.dtype).reshape(-1)[:n]
            _residual(worker, x[:n], sent)
            payload = payload[mine]
        else:
            payload = _encode_rows(x.view(rows, shard)[mine], self.wire)
        size = payload.shape[1]
        on_gpu = self.device.type == "cuda"  # pinned host copies only for device tensors
        send = self._stager.buffer(torch.uint8, nodes * size, slot=0, device_copy=on_gpu)
        recv = self._stager.buffer(torch.uint8, nodes * size, slot=1, device_copy=on_gpu)
        send.copy_(payload.reshape(-1))
        self._mpi("all-to-all", self.inter_ranks, self.comm.Alltoall, send, recv)
        versions = _decode_rows(recv.view(nodes, size).to(self.device), shard, self.wire,
                                self.dtype)
        mean = versions[0].clone()
        for k in range(1, nodes):  # in node order: the same bits on every node
            mean.add_(versions[k])
        mean.div_(nodes)
        if feedback:
            residual = self._server[server:server + self.slices * shard].view(self.slices, shard)
            mean.add_(residual[self.slice])
            out = _encode_rows(mean.view(1, shard), self.wire)
            _residual(residual[self.slice], mean, _decode_rows(out, shard, self.wire,
                                                                self.dtype)[0])
        else:
            out = _encode_rows(mean.view(1, shard), self.wire)
        self.bytes_sent += 2 * (nodes - 1) * size
        # A split node also passes on its slice's server residual (see below).
        extra = shard * self.elem if feedback and self.slices > 1 else 0
        record = self._stager.buffer(torch.uint8, nodes * size + extra, slot=2,
                                     device_copy=on_gpu)
        self._mpi("allgather", self.inter_ranks, self.comm.Allgather, out.reshape(-1).cpu(),
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
                residual.copy_(_view(node[:, nodes * size:], self.dtype))
            record = node[:, :nodes * size]
        result = _decode_rows(record.reshape(rows, size).to(self.device), shard, self.wire,
                              self.dtype)
        seg.copy_(result.reshape(-1)[:n])

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
                             "bucket): resume with the same --wire and layout")
        self._worker.copy_(state["worker"])
        self._server.copy_(state["server"])

    def _layout(self) -> list[int]:
        return [self.num_nodes, self.slices, self.bucket_elems]

    def close(self) -> None:
        """Stop the watchdog this object made for itself (at exit that happens anyway)."""
        if self._own_watchdog:
            self.watchdog.stop()


def _residual(out: torch.Tensor, x: torch.Tensor, sent: torch.Tensor) -> None:
    """``out = x - sent``, the error carried to the next exchange.

    A non-finite value's residual is dropped (0): carried on, it would make that chunk
    non-finite in every later exchange, even once the input is finite again.
    """
    torch.sub(x, sent, out=out)
    out.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


__all__ = ["INT8_CHUNK", "MEAN_BUCKET_ELEMS", "WIRES", "CompressedMean", "decode", "encode",
           "payload_bytes"]
