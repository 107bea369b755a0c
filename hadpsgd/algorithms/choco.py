"""Compressed gossip that keeps the replicas' average: CHOCO-SGD's estimates, per ring edge.

Plain compressed gossip (``--wire int8``) sends ``encode(w + e)``, the whole model: a code
must describe every weight, which caps it near 8x (int4). A top-k code of a whole model is
useless (the largest 1.6 % of the weights, not of what changed). CHOCO-SGD (Koloskova et
al., 2019) compresses *differences* instead: every node keeps public estimates ``x^`` of its
neighbours' models and of its own, and sends ``Q(x - x^)``, what its own estimate lacks;
both ends add the decoded message to the estimate, and the consensus step moves each model
towards its neighbours' *estimates*: ``x_i += gamma * sum_j w_ij (x^_j - x^_i)``.

ADPSGD's gossip is pairwise on a ring, so the estimates are kept per edge: for each ring
neighbour ``p``, ``mine`` (this leader's model as ``p`` knows it) and ``theirs`` (``p``'s, as
this leader knows it). Both ends of an edge hold the same two tensors, mirrored, because
they start from the same values and add the same decoded bytes in the same order. At an
exchange each end sends ``encode(x - mine)``; both add the two decoded messages to the
edge's estimates; each end's delta is ``gamma / 2 * (theirs - mine)``, the exact negation of
its partner's (IEEE subtraction is antisymmetric), so the sum of the replicas is conserved
bit for bit as by plain gossip, and ``x - mine`` is the error feedback: what a message did
not carry is sent once it grows into its chunk's top k.

Every edge to a ring neighbour starts at the model all replicas share when the gossip
starts (rank 0's, broadcast): the same on both ends, and close to both models (CHOCO-SGD's
zero start would have each delta at first pull a weight towards half of a neighbour's whole
weight). An edge without estimates on either end (a neighbour gained later) starts instead
with one dense exchange of the two models in fp32, which sets ``mine`` and ``theirs`` to
them on both ends: both ends send a flag saying whether they hold the edge, and the dense
exchange runs unless both do, so they always agree. The estimates are not checkpointed: a
resumed run's replicas all load the same model, and its edges start there again.
"""

from __future__ import annotations

import torch

from hadpsgd.comm.codec import decode, encode

DEFAULT_GOSSIP_STEP = 0.2
"""CHOCO's consensus step gamma when none is given. Measured with top-k 1/64 on ADPSGD's
ring of 4 (docs/results.md): 1 (a partner's estimate pulls half way, as plain gossip) lost
the model (77 % WER on the espeak set), 0.2 was the best of 0.5, 0.2 and 0.05 there and on
human voices; CHOCO-SGD needs a step small against the code's share for the replicas to
meet (the consensus test: 0.5 did not close their gap, 0.02 closed 98 % of it)."""


class ChocoEdges:
    """The public estimates of every ring edge of one super-learner (see the module docstring).

    Args:
        numel: Parameters in the flat model.
        dtype: Their dtype (the estimates' and the deltas').
        wire: The codec spec of the messages (``topk:<fraction>``, ``int4``, ...).
        step: The consensus step gamma, in (0, 1].
    """

    def __init__(self, numel: int, dtype: torch.dtype, wire: str,
                 step: float = DEFAULT_GOSSIP_STEP) -> None:
        if not 0.0 < step <= 1.0:
            raise ValueError(f"the gossip step must be in (0, 1], got {step}")
        self.numel, self.dtype, self.wire, self.step = numel, dtype, wire, step
        self.edges: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Peer -> (``mine``, ``theirs``): host tensors, identical (mirrored) on its end."""

    def seed(self, peers: list[int], x: torch.Tensor) -> None:
        """Start the edges to ``peers`` at ``x``, a model every end of them holds alike."""
        for p in peers:
            self.edges[p] = (x.clone(), x.clone())

    def holds(self, peer: int) -> bool:
        """Whether the edge to ``peer`` has its estimates."""
        return peer in self.edges

    def message(self, peer: int, x: torch.Tensor) -> torch.Tensor:
        """The bytes to send to ``peer``: the code of what its estimate of ``x`` lacks."""
        mine, _ = self.edges[peer]
        return encode(x - mine, self.wire)

    def mix(self, peer: int, sent: torch.Tensor, received: torch.Tensor,
            out: torch.Tensor) -> torch.Tensor:
        """Add both messages to the edge's estimates; the delta to add to this model.

        Args:
            peer: The partner.
            sent: This end's message (:meth:`message`), as sent.
            received: The partner's message, as received.
            out: Where the delta goes (``numel`` values of ``dtype``).
        """
        mine, theirs = self.edges[peer]
        mine.add_(decode(sent, self.numel, self.wire, self.dtype))
        theirs.add_(decode(received, self.numel, self.wire, self.dtype))
        return torch.sub(theirs, mine, out=out).mul_(0.5 * self.step)

    def start(self, peer: int, own: torch.Tensor, other: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
        """Start the edge from a dense exchange of the two models; the delta of that exchange.

        Args:
            peer: The partner.
            own: This end's model, as sent.
            other: The partner's model, as received.
            out: Where the delta goes.
        """
        self.edges[peer] = (own.clone(), other.clone())
        return torch.sub(other, own, out=out).mul_(0.5 * self.step)


__all__ = ["DEFAULT_GOSSIP_STEP", "ChocoEdges"]
