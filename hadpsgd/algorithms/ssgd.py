"""Synchronous SGD: average the gradients of all learners every step, then step locally."""

from __future__ import annotations

import torch
from torch import nn

from hadpsgd.algorithms.base import Algorithm, register
from hadpsgd.comm import Topology


@register("ssgd", "synchronous SGD: one gradient allreduce over all learners every step")
class SSGD(Algorithm):
    """Synchronous data-parallel SGD over one flat gradient buffer per dtype.

    Each step is one allreduce (average) per dtype buffer followed by the local optimizer
    step. Since every learner applies the same averaged gradient to the same parameters with
    the same optimizer, the replicas stay bit-identical without any parameter traffic.

    Args:
        model: The local replica.
        optimizer: Any ``torch.optim`` optimizer over ``model``'s parameters.
        topo: The communication topology.
        max_grad_norm: Clip the averaged gradient to this global L2 norm; 0 disables.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 topo: Topology, max_grad_norm: float = 0.0) -> None:
        super().__init__(model, optimizer, topo, max_grad_norm=max_grad_norm)

    def reduce_grads(self) -> None:
        """Average the gradients over all learners (the local optimizer step follows)."""
        for buf in self.grads.buffers.values():
            self.topo.allreduce_(buf, op="avg")
