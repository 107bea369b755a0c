"""Synchronous SGD: average the gradients of all learners every step, then step locally."""

from __future__ import annotations

from hadpsgd.algorithms.base import Algorithm
from hadpsgd.algorithms.registry import register
from hadpsgd.comm.overlap import GradScope


@register("ssgd", "synchronous SGD: one gradient allreduce over all learners every step")
class SSGD(Algorithm):
    """Synchronous data-parallel SGD over bucketed flat gradient buffers.

    Each step averages the gradients over all learners (bucket by bucket, during backward
    when the reduction overlaps it) and then takes the local optimizer step. Since every
    learner applies the same averaged gradient to the same parameters with the same
    optimizer, the replicas stay bit-identical without any parameter traffic. Constructor
    arguments: those of :class:`Algorithm`.
    """

    def grad_scope(self) -> GradScope:
        """Every step averages over all learners."""
        return "world"
