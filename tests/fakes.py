"""Stand-ins for the unit tests: one fake topology, checked against the real one.

``tests/unit/test_fakes.py`` holds :class:`OneLearner` to :class:`hadpsgd.comm.Topology`'s
interface (every name it has, the real one has, with the same parameters), so a change of
``Topology`` that the fake does not follow fails there and not as a puzzling unit test.
"""

from __future__ import annotations

import torch


class OneLearner:
    """The topology of a single process on CPU (one node of one learner): no communication.

    A mean or a sum over one learner is the value itself; a broadcast from rank 0 changes
    nothing.
    """

    rank, size, local_rank, local_size, node, num_nodes = 0, 1, 0, 1, 0, 1
    device = torch.device("cpu")

    def require_equal_nodes(self, what: str) -> None:
        """One node is always equal to itself."""

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """The tensor as it is."""
        return tensor

    def allreduce_(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        """The tensor as it is."""
        return tensor
