"""A block's progress as low-rank factors: PowerSGD's power iteration, the rest kept locally.

``--bmuf-low-rank R`` sends each weight matrix's block progress ``M`` (``theta_local -
theta_init``, a matrix of ``m x n`` after flattening the trailing dimensions) as a rank-R
product, after Vogels et al., *PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization* (NeurIPS 2019), Algorithm 1, applied to block deltas instead of
gradients:

1. ``P = M Q`` and its mean over the nodes (``Q``: ``n x R``, identical on every node);
2. ``P^ = orthonormal(P)`` (a reduced QR: the same bits on every rank, as its input is);
3. ``Q = M^T P^`` and its mean over the nodes;
4. the node's delta is replaced by ``P^ Q^T``, which the block filter applies as the mean;
5. what it left of this node's progress, ``M - P^ Q^T``, is added to the node's model at the
   next block's start (:meth:`LowRankDelta.keep`), so the node goes on from the global model
   plus its own unsent progress and its next delta carries it.

Since ``Q`` and ``P^`` are shared, the two means equal ``(mean M) Q`` and ``(mean M)^T P^``:
what every node applies is the nodes' mean delta projected on ``P^``. ``Q`` starts random (a
seed every node shares) and is warm-started from the last block (the paper's reuse of the
previous approximation), so one power iteration a block tracks the dominant directions.

Step 5 is where this differs from the paper's error feedback (a residual added to the next
message): BMUF restarts every worker from the global model each block, so a residual kept
aside is progress the worker then makes again from the same point, and both are sent; at
rank 1 that overshoot drove FSDD's held-out loss up (60-68 % WER on fold A, 3 seeds, where
keeping the rest in the model gave 7-14 %; docs/results.md). A matrix is sent in factors only
where ``R (m + n) < m n``; vectors (biases, norms' scales) and matrices too small for it go
with the run's ``--wire`` as before. The factors cross in the side channel's format without
its error feedback, ``R (m + n)`` values a matrix where the dense wire sends ``m n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hadpsgd.algorithms.bmuf.moments import Slots

LOW_RANK_SEED = 0x5EED
"""Seed of the first ``Q`` of every matrix (the same on every node, whatever ``--seed``)."""


@dataclass
class _Matrix:
    """One weight matrix of a fragment: where its values sit in the sent segment."""

    start: int
    """Offset in the fragment's model segment."""
    rows: int
    cols: int


def matrices(slots: Slots, lo: int, rank: int) -> list[_Matrix]:
    """The parameters of ``slots`` (offsets from ``lo``) worth sending as rank-``rank`` factors.

    A parameter of two or more dimensions is the matrix ``shape[0] x prod(shape[1:])``;
    it is worth it where its factors are smaller than it, ``rank (m + n) < m n``.
    """
    out = []
    for param, offset in slots:
        if param.dim() < 2:
            continue
        rows = param.shape[0]
        cols = param.numel() // rows
        if rank * (rows + cols) < rows * cols:
            out.append(_Matrix(offset - lo, rows, cols))
    return out


class LowRankDelta:
    """The low-rank mean of one fragment's model segment, its ``Q``'s and what it left.

    Args:
        rank: The factors' rank R (>= 1).
        mats: The segment's matrices (:func:`matrices`).
        numel: Elements of the segment.
        dtype: Its dtype.
        device: Its device.
    """

    def __init__(self, rank: int, mats: list[_Matrix], numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rank, self.mats, self.numel = rank, mats, numel
        covered = torch.zeros(numel, dtype=torch.bool)
        for m in mats:
            covered[m.start:m.start + m.rows * m.cols] = True
        # What is not in a matrix (vectors, small matrices) goes with the run's wire.
        self.rest = torch.nonzero(~covered).flatten().to(device)
        gen = torch.Generator().manual_seed(LOW_RANK_SEED)
        self.q = [torch.randn(m.cols, rank, generator=gen, dtype=torch.float64)
                  .to(dtype=dtype, device=device) for m in mats]
        self.left: list[torch.Tensor] | None = None
        """What the factors left of this node's last delta, until :meth:`keep` adds it to
        the node's model (per matrix)."""

    @property
    def factor_numel(self) -> tuple[int, int]:
        """Values of all ``P``'s and of all ``Q``'s (what one block sends of the matrices)."""
        return (sum(m.rows for m in self.mats) * self.rank,
                sum(m.cols for m in self.mats) * self.rank)

    def mean_(self, part: torch.Tensor, mean: Any, key: str) -> None:
        """Replace ``part`` (this node's delta) by the nodes' mean: factors and the rest.

        Args:
            part: The fragment's model segment (identical on the learners of a node).
            mean: ``mean(key, tensor, feedback)``: the cross-node mean, in place.
            key: Names this segment's exchanges.
        """
        if self.rest.numel():
            rest = part[self.rest]
            mean(f"{key}-rest", rest, True)
            part[self.rest] = rest
        if not self.mats:
            return
        ms = [part[m.start:m.start + m.rows * m.cols].view(m.rows, m.cols).clone()
              for m in self.mats]
        p = torch.cat([(mm @ q).reshape(-1) for mm, q in zip(ms, self.q, strict=True)])
        mean(f"{key}-P", p, False)
        ps, at = [], 0
        for m in self.mats:
            block = p[at:at + m.rows * self.rank].view(m.rows, self.rank)
            at += m.rows * self.rank
            ps.append(torch.linalg.qr(block.double()).Q.to(block.dtype))
        q = torch.cat([(mm.T @ ph).reshape(-1) for mm, ph in zip(ms, ps, strict=True)])
        mean(f"{key}-Q", q, False)
        at, left = 0, []
        for i, (m, mm, ph) in enumerate(zip(self.mats, ms, ps, strict=True)):
            self.q[i] = q[at:at + m.cols * self.rank].view(m.cols, self.rank).clone()
            at += m.cols * self.rank
            approx = ph @ self.q[i].T
            left.append(mm.sub_(approx))
            part[m.start:m.start + m.rows * m.cols].copy_(approx.reshape(-1))
        self.left = left

    def keep(self, local: torch.Tensor) -> None:
        """Add what the factors left to this node's ``local`` model segment, once.

        Called once the filter has set the next block's start: the node then goes on from
        the global model plus its own unsent progress, which its next delta carries.
        """
        if self.left is None:
            return
        for m, e in zip(self.mats, self.left, strict=True):
            local[m.start:m.start + m.rows * m.cols].add_(e.reshape(-1))
        self.left = None

    def state_dict(self) -> dict[str, Any]:
        """The ``Q``'s and what is left to keep (per node), for an exact resume."""
        return {"q": [q.cpu() for q in self.q],
                "left": None if self.left is None else [e.cpu() for e in self.left]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (of the same fragment layout and rank).

        Raises:
            ValueError: If the state is of another layout or rank.
        """
        saved = [tuple(q.shape) for q in state["q"]]
        if saved != [tuple(q.shape) for q in self.q]:
            raise ValueError("the saved low-rank factors are of another layout or rank")
        self.q = [s.to(o.device, o.dtype) for s, o in zip(state["q"], self.q, strict=True)]
        left = state.get("left")
        self.left = None if left is None else [
            e.to(q.device, q.dtype) for e, q in zip(left, self.q, strict=True)]
