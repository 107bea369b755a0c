"""The gradient side of a step: flat buffers, buckets reduced during backward, one sync.

:class:`GradSync` owns the flat gradient buffers of an :class:`~hadpsgd.algorithms.base.
Algorithm`. With ``overlap`` it registers a ``post_accumulate_grad`` hook on every
parameter, so that a bucket's reduction starts in the comm layer's background thread as soon
as backward has produced its last gradient (:class:`hadpsgd.comm.overlap.BucketReducer`);
:meth:`GradSync.finish` then only waits for the tail. :meth:`GradSync.check` reads, in one
host synchronisation, what the step needs to know about the gradients: whether this
learner's own gradient was finite, whether the reduced one is, and its norm for clipping.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hadpsgd.comm import FlatBuffer, World
from hadpsgd.comm.overlap import BucketPlan, BucketReducer, GradScope

GRAD_WIRES: tuple[str, ...] = ("fp32", "bf16")
"""The values of ``--grad-wire``."""

DEFAULT_GRAD_BUCKET_MB = 25.0
"""Bucket size of the overlapped gradient reduction (DDP's default ``bucket_cap_mb``)."""


@dataclass(frozen=True)
class GradCheck:
    """What one host synchronisation tells about a step's gradients."""

    local_finite: bool
    """This learner's own gradient, before any reduction, was finite."""
    finite: bool
    """The reduced gradient (what the optimizer would apply) is finite."""
    norm: float
    """Global L2 norm of the reduced gradient (NaN when not asked for)."""
    loss: float
    """The step's loss, read in the same synchronisation (NaN when not given)."""


def _wide(t: torch.Tensor) -> torch.dtype | None:
    # Half precision sums overflow at 65504: accumulate them in float32, the rest as they are.
    return torch.float32 if t.element_size() < 4 else None


def _ring_bytes(nbytes: int, n: int) -> int:
    """What a rank sends in a ring allreduce of ``nbytes`` over ``n`` learners."""
    return 2 * (n - 1) * nbytes // n


def internode_share(nbytes: int, topo: World) -> int:
    """What a rank sends *between nodes* in a hierarchical allreduce of ``nbytes``.

    The node's sum is cut in ``local_size`` slices, slice *j* crosses the nodes as a ring
    among local rank *j* of every node, 2 (N - 1) / N of its bytes (N nodes), and the rest
    stays inside the node. The per-rank mean of the ``leader`` form too (there local rank 0
    sends all of it). Also what the rank receives: a ring is symmetric.
    """
    return _ring_bytes(nbytes, topo.num_nodes) // max(1, topo.local_size)


def total(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` (float32 for half precision): NaN or Inf if any element is."""
    return t.sum(dtype=_wide(t))


class GradSync:
    """Flat gradient buffers and their bucketed, optionally overlapped, averaging.

    Args:
        params: The trainable parameters, in the model's order.
        topo: The communication topology.
        scope: Called once per step: average the gradients over the ``world``, the
            ``node`` (a super-learner), or not at all (None).
        bucket_mb: Bucket size in MiB.
        overlap: Start each bucket's reduction during backward (needs MPI_THREAD_MULTIPLE
            and more than one learner; otherwise the same buckets are reduced after it):
            True/``on``, False/``off`` or ``auto``: on when the parameters are on a GPU. On
            CPU the background reduction competes with backward for the same cores (Open
            MPI's blocking calls spin while they wait), which measured slower than reducing
            after backward (docs/benchmarks.md).
        wire: ``fp32`` (the buckets as they are) or ``bf16``: each bucket is rounded to
            bfloat16 for the wire and averaged in fp32 where MPI carries it
            (:meth:`~hadpsgd.comm.Topology.half_mean_`), or by NCCL in bfloat16 where NCCL
            carries the whole scope (DDP's ``bf16_compress_hook``), then cast back.
        world: Whether ``scope`` can be ``world`` (False: every mean stays in the node, and
            no pipelined world route is built).
    """

    def __init__(self, params: list[nn.Parameter], topo: World,
                 scope: Callable[[], GradScope], bucket_mb: float = DEFAULT_GRAD_BUCKET_MB,
                 overlap: bool | str = "auto", wire: str = "fp32", world: bool = True) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"grad bucket size must be > 0 MiB, got {bucket_mb}")
        if wire not in GRAD_WIRES:
            raise ValueError(f"grad wire must be one of {', '.join(GRAD_WIRES)}, got {wire!r}")
        self.wire = wire
        self.wire_bytes = 0
        """Gradient bytes this rank sent in reductions so far: for ``bf16`` the payloads it
        sent, for ``fp32`` a ring allreduce's share, 2 (n - 1) / n of each bucket's bytes
        (MPI picks its own algorithm; the ring is the bandwidth-optimal one)."""
        self.internode_bytes = 0
        """Of those, this rank's share of what crossed nodes (:func:`internode_share` of each
        world-scope bucket on the wire; a node-scope mean crosses none). A ring is symmetric:
        the rank received as many."""
        self.topo = topo
        self.flat = FlatBuffer(params, kind="grad")
        layout = []
        for view in self.flat.views:
            base = self.flat.buffers[view.dtype]
            layout.append((view.dtype, view.storage_offset() - base.storage_offset(),
                           view.numel()))
        self.plan = BucketPlan(layout, max(1, int(bucket_mb * 2**20)))
        if overlap not in (True, False, "on", "off", "auto"):
            raise ValueError(f"overlap must be True, False, 'on', 'off' or 'auto', got {overlap!r}")
        on_gpu = bool(params) and params[0].device.type == "cuda"
        wanted = overlap in (True, "on") or (overlap == "auto" and on_gpu)
        background = wanted and topo.size > 1 and topo.thread_multiple
        # The backstop only fires if a reduction hangs outside the watchdog's guards.
        self._scope_of_step = scope
        # Gradients of a hierarchical world: each piece's inter-node allreduce runs beside
        # the next piece's intra-node phase (comm.pipeline; on GPUs the node's phases on
        # NCCL, the shard through page-locked memory). Collective: asked on every rank
        # (``world`` is decided by the options, alike everywhere); none where no mean is
        # world-wide.
        self._pipe = None if topo.size == 1 or not world else topo.grad_pipeline()
        self._piped = False  # a world mean is in the pipeline: drained in finish()
        self.reducer = BucketReducer(self.plan, self.flat.buffers, self._reduce, self._scope,
                                     total, background,
                                     timeout=topo.timeout + 30.0 if background else 0.0)
        self._hooks = []
        if background:
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                           for i, p in enumerate(self.flat.params)]
        self._local: list[torch.Tensor] = []
        self.accumulating = False
        """Backward passes add to the gradients without reducing them (``Distributed.no_sync``):
        the hooks only gather; the first pass outside reduces the sum as it lands."""
        self._deferred = False  # a bucket's mean is in flight on NCCL's stream
        self._unsettled = False  # joined means whose host wait check() makes
        # bf16 on NCCL: (bucket, its bf16 copy in flight), cast back after the join.
        self._halves: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def overlapped(self) -> bool:
        """Whether buckets are reduced during backward."""
        return self.reducer.background

    def _scope(self) -> GradScope:
        # A scope of one learner reduces nothing: no reduction, no separate local sums.
        scope = self._scope_of_step()
        if (scope == "world" and self.topo.size == 1) or (scope == "node"
                                                           and self.topo.local_size == 1):
            return None
        return scope

    def _reduce(self, view: torch.Tensor, scope: str) -> None:
        if scope not in ("world", "node"):
            raise ValueError(f"gradient scope must be 'world' or 'node', got {scope!r}")
        n = self.topo.size if scope == "world" else self.topo.local_size
        if scope == "world":  # bf16 halves what crosses the nodes too
            half = self.wire == "bf16" and view.dtype == torch.float32
            self.internode_bytes += internode_share(
                view.numel() * (2 if half else view.element_size()), self.topo)
        if self.wire == "bf16" and view.dtype == torch.float32:
            self._reduce_half(view, scope, n)
            return
        self.wire_bytes += _ring_bytes(view.numel() * view.element_size(), n)
        # On NCCL the mean is queued on NCCL's stream and joined once in finish(): waiting
        # here would make backward's next kernels wait for every bucket's allreduce.
        if view.is_cuda and self.topo.mean_deferred_(view, scope):
            self._deferred = True
            return
        if scope == "world":
            if self._pipe is not None and self._pipe.applies(view):
                self._pipe.mean_(view, n)
                self._piped = True
                return
            self.topo.allreduce_(view, op="avg")
        else:
            self.topo.intra_allreduce_(view, op="avg")

    def _reduce_half(self, view: torch.Tensor, scope: str, n: int) -> None:
        """``view``'s mean with bf16 on the wire (see ``wire`` in the class docstring)."""
        # The bf16 copy is made only for a route NCCL carries whole: an MPI leg codes the
        # bucket itself (half_mean_), and a cast made before asking was thrown away there.
        if view.is_cuda and self.topo.deferrable(scope):
            half = view.to(torch.bfloat16)
            self.topo.mean_deferred_(half, scope)
            self.wire_bytes += _ring_bytes(half.numel() * half.element_size(), n)
            self._halves.append((view, half))
            self._deferred = True
            return
        self.wire_bytes += self.topo.half_mean_(view, scope)

    def _ready(self, index: int, param: nn.Parameter) -> None:
        # Runs on autograd's thread right after the gradient was accumulated. A gradient
        # that left its view (zero_grad(set_to_none=True), an assigned .grad) goes back in.
        self.flat.gather_grad(index)
        if not self.accumulating:
            self.reducer.param_ready(index)

    def finish(self) -> None:
        """After backward: reduce what is left and wait for every bucket of this step."""
        # Gradients whose hooks did not fire (assigned by hand, unused parameters) go into
        # their views first; those already reduced or in flight are views, so untouched.
        self.flat.gather_grads()
        self._local = self.reducer.finish()
        if self._piped:  # on this thread, after every bucket's first phase: one order
            self._piped = False
            self._pipe.drain()  # type: ignore[union-attr] - set with _piped
        if self._deferred:  # the optimizer reads the means: the stream waits for NCCL here;
            self._deferred = False  # the host waits in check(), the step's one sync
            self.topo.join_deferred(host_wait=False)
            self._unsettled = True
            for view, half in self._halves:
                view.copy_(half)
            self._halves.clear()

    def check(self, norm: bool, loss: torch.Tensor | None = None) -> GradCheck:
        """Finiteness of the local and reduced gradients and the reduced norm, one sync.

        NaN and Inf propagate through a sum, so one sum per buffer tells; the local sums
        were taken bucket by bucket before each reduction. The norm accumulates in the
        buffers' own precision (float32 accumulation for half precision), not a float64 copy.

        Args:
            norm: Also compute the global L2 norm (for clipping).
            loss: The step's loss (a 0-d tensor), read in the same synchronisation.
        """
        bufs = list(self.flat.buffers.values())
        parts = [torch.stack([total(b).double() for b in bufs]).sum()]
        parts.append(torch.stack([s.double() for s in self._local]).sum() if self._local
                     else parts[0])
        if norm:
            sq = [torch.linalg.vector_norm(b, dtype=_wide(b)).double() ** 2 for b in bufs]
            parts.append(torch.stack(sq).sum().sqrt())
        if loss is not None:
            parts.append(loss.detach().reshape(()).to(parts[0]))
        stacked = torch.stack(parts)
        if self._unsettled:
            # The joined means' host wait and this read in one synchronisation, under the
            # deadline (a peer that never sends is named, not waited for without end).
            self._unsettled = False
            host = stacked.to("cpu", non_blocking=True)  # pinned: the copy is stream-ordered
            # Read only after a wait that covers the copy; where none was owed after all,
            # the plain synchronising read.
            values = host.tolist() if self.topo.settle_deferred() else stacked.tolist()
        else:
            values = stacked.tolist()  # the step's one device synchronisation
        return GradCheck(local_finite=math.isfinite(values[1]), finite=math.isfinite(values[0]),
                         norm=values[2] if norm else math.nan,
                         loss=values[-1] if loss is not None else math.nan)

    def zero_(self) -> None:
        """Zero every gradient (keeping the views)."""
        self.flat.gather_grads()
        self.flat.zero_()

    def close(self) -> None:
        """Remove the hooks and stop the reduction thread."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.reducer.close()
        if self._pipe is not None:
            self._pipe.close()


__all__ = ["DEFAULT_GRAD_BUCKET_MB", "GRAD_WIRES", "GradCheck", "GradSync", "internode_share",
           "total"]
