"""Synchronous SGD: average the gradients of all learners every step, then step locally."""

from __future__ import annotations

from dataclasses import dataclass

from hadpsgd.algorithms.base import Algorithm
from hadpsgd.algorithms.options import AlgoOptions
from hadpsgd.algorithms.registry import register
from hadpsgd.comm.overlap import GradScope


@dataclass(frozen=True)
class SSGDOptions(AlgoOptions):
    """SSGD options."""

    sync_buffers: bool = True
    """Keep the model's buffers (BatchNorm's running statistics) in agreement: ssgd takes
    rank 0's after every step (DDP's broadcast_buffers), bmuf and adpsgd average the
    floating-point ones (integer ones: rank 0's); --no-sync-buffers leaves each learner its
    own (docs/api.md, Buffers)."""


@register("ssgd", "synchronous SGD: one gradient allreduce over all learners every step")
class SSGD(Algorithm):
    """Synchronous data-parallel SGD over bucketed flat gradient buffers.

    Each step averages the gradients over all learners (bucket by bucket, during backward
    when the reduction overlaps it) and then takes the local optimizer step. Since every
    learner applies the same averaged gradient to the same parameters with the same
    optimizer, the replicas stay bit-identical without any parameter traffic; the model's
    buffers (BatchNorm's statistics, from each learner's own batch) become rank 0's after
    every step, in one broadcast, as DDP's ``broadcast_buffers`` (none for a model without
    buffers; ``sync_buffers=False`` leaves each learner its own). Constructor arguments:
    those of :class:`Algorithm`.
    """

    Options = SSGDOptions
    options: SSGDOptions

    def grad_scope(self) -> GradScope:
        """Every step averages over all learners."""
        return "world"
