"""An alpha-beta cost model of the three algorithms' communication, and its least-squares fit.

Every transfer of ``n`` bytes over one link costs ``alpha + n * beta`` seconds (``alpha``: the
per-message latency, ``beta``: seconds per byte, 1 / bandwidth). Collectives are the
bandwidth-optimal ring forms (Patarasuk and Yuan 2009, reference [11] of the h-adpsgd paper):

- ring allreduce of ``n`` bytes over ``p`` ranks: ``2 (p - 1) alpha + 2 (p - 1) / p * n * beta``
  (a reduce-scatter then an allgather, each ``p - 1`` steps of ``n / p`` bytes);
- ring reduce-scatter or allgather alone: half of that;
- pipelined broadcast: ``(p - 1) alpha + n * beta``;
- pair exchange (send ``n`` and receive ``n`` at once, full duplex): ``alpha + n * beta``.

A cluster has two levels, a fast link inside a node (NVLink, shared memory) and a network
link between nodes; ``ranks_per_node`` learners share one node and one network interface.
The hierarchical allreduce (hadpsgd's ``shard`` form: reduce-scatter in the node, the
``ranks_per_node`` shard allreduces across nodes at once, allgather in the node) then costs
``ring(n, k, intra) + ring(n, N, inter)`` for ``k`` learners per node and ``N`` nodes: the ``k``
concurrent shard rings share the node's interface, so together they move the bytes of one ring
over the nodes of the whole message.

Per-learner step times (``c`` = compute of one forward/backward/update at the per-learner batch,
``n`` = model bytes):

- ``ssgd``: ``c + hier(n)`` (the gradient allreduce is not overlapped with compute);
- ``bmuf``: ``c + ring(n, k, intra) + (ring(m n, N, inter) + allgather(m n, k, intra)) / tau``,
  with ``m`` buffers synchronised per block (model + Adam's two moments: 3);
- ``bmuf-ov`` (``--bmuf-overlap``): the same block sync in the background during the next
  ``tau`` steps; a step waits for ``max(0, block - tau * T_local) / tau`` only, and
  ``bmuf-ov-int8`` sends ``m n`` at :data:`INT8_WIRE_RATIO` of the bytes;
- ``h-adpsgd``: ``c + ring(n, k, intra) + e * bcast(n, k, intra)``: the gossip exchange
  ``alpha_inter + n beta_inter`` runs in a background thread, overlapped with compute; only the
  node leader's delta broadcast is on the critical path, ``e`` = exchanges per step
  ``= min(1, T / t_exchange)`` (at most one per step, as in hadpsgd);
- ``adpsgd`` (flat, one learner per super-learner): ``c``; pairs alternate between in-node and
  node-straddling rounds, the straddling round puts two exchanges on each interface.

Speedup at ``p`` learners is ``p * T(1) / T(p)``; at ``p = 1`` nothing is communicated, so it is 1.

Not modelled (so the projections are upper bounds): the overlap of SSGD's allreduce with the
backward pass (would raise SSGD), host staging over PCIe, the cost of applying updates and
deltas (memory traffic), data loading, evaluation, stragglers and network contention from other
jobs, and the convergence cost of each algorithm (epochs to a target loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALGOS = ("ssgd", "bmuf", "bmuf-ov", "bmuf-ov-int8", "h-adpsgd", "adpsgd")
"""Algorithms the model projects (``adpsgd`` is the flat form, one learner per super-learner;
``bmuf-ov``: ``--bmuf-overlap``, ``bmuf-ov-int8``: with ``--wire int8`` too)."""
INT8_WIRE_RATIO = (1 + 4 / 1024) / 4
"""Bytes of an int8 payload per fp32 byte: one byte a value and a 4-byte scale per 1024."""


@dataclass(frozen=True)
class Link:
    """One communication level: ``alpha + n * beta`` seconds to move ``n`` bytes."""

    alpha: float
    """Latency per message, seconds."""
    beta: float
    """Seconds per byte (1 / bandwidth)."""

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}")

    @property
    def gbps(self) -> float:
        """Bandwidth in GB/s (1e9 bytes/s); ``inf`` when ``beta`` is 0."""
        return math.inf if self.beta == 0 else 1e-9 / self.beta


@dataclass(frozen=True)
class Cluster:
    """What a projection needs to know about a machine and a model."""

    name: str
    """Short name used in the table and the JSON record."""
    intra: Link
    """The link between learners of one node."""
    inter: Link
    """The network link between nodes (one interface per node)."""
    ranks_per_node: int
    """Learners per node (GPUs per server)."""
    compute_s: float
    """Seconds of one learner's forward/backward/update at the per-learner batch."""
    model_bytes: int
    """Bytes of the model (= of its gradient)."""
    note: str = ""
    """Where the figures come from."""


# ---------------------------------------------------------------------------- collectives
def _check(nbytes: float, p: int) -> None:
    if p < 1:
        raise ValueError(f"rank count must be >= 1, got {p}")
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0, got {nbytes}")


def ring_allreduce(nbytes: float, p: int, link: Link) -> float:
    """Seconds of a ring allreduce of ``nbytes`` over ``p`` ranks: ``2(p-1)(alpha + n/p beta)``."""
    _check(nbytes, p)
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def ring_allgather(nbytes: float, p: int, link: Link) -> float:
    """Seconds of a ring allgather (or reduce-scatter) of ``nbytes`` in total over ``p`` ranks."""
    _check(nbytes, p)
    return (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta


def broadcast(nbytes: float, p: int, link: Link) -> float:
    """Seconds of a pipelined broadcast of ``nbytes`` to ``p - 1`` ranks (0 when ``p = 1``)."""
    _check(nbytes, p)
    return 0.0 if p == 1 else (p - 1) * link.alpha + nbytes * link.beta


def pair_exchange(nbytes: float, link: Link) -> float:
    """Seconds of one full-duplex exchange of ``nbytes`` each way between two ranks."""
    _check(nbytes, 1)
    return link.alpha + nbytes * link.beta


def layout(p: int, ranks_per_node: int) -> tuple[int, int]:
    """``(learners per node, nodes)`` of ``p`` learners packed onto nodes of ``ranks_per_node``.

    Raises:
        ValueError: If ``p`` spans several nodes but does not fill them equally.
    """
    if p < 1 or ranks_per_node < 1:
        raise ValueError(f"learners and ranks per node must be >= 1, got {p}, {ranks_per_node}")
    if p <= ranks_per_node:
        return p, 1
    if p % ranks_per_node:
        raise ValueError(f"{p} learners do not fill nodes of {ranks_per_node} equally")
    return ranks_per_node, p // ranks_per_node


def hierarchical_allreduce(nbytes: float, p: int, ranks_per_node: int, intra: Link,
                           inter: Link) -> float:
    """Seconds of the two-level allreduce: ``ring(n, k, intra) + ring(n, N, inter)``."""
    k, nodes = layout(p, ranks_per_node)
    return ring_allreduce(nbytes, k, intra) + ring_allreduce(nbytes, nodes, inter)


# ---------------------------------------------------------------------------- step times
@dataclass(frozen=True)
class StepCost:
    """One learner's average step under an algorithm."""

    total_s: float
    """Seconds per step (compute plus the communication on the critical path)."""
    compute_s: float
    """Compute part."""
    exposed_comm_s: float
    """Communication the step waits for."""
    hidden_comm_s: float = 0.0
    """Background communication (overlapped with compute): per gossip exchange, or per
    overlapped BMUF block sync."""
    exchanges_per_step: float | None = None
    """Gossip exchanges per local step (``None`` for the synchronous algorithms)."""


def step_time(algo: str, p: int, cluster: Cluster, sync_period: int = 8,
              sync_buffers: int = 3) -> StepCost:
    """One learner's step time at ``p`` learners (see the module docstring for the formulas).

    Args:
        algo: One of :data:`ALGOS`.
        p: Number of learners.
        cluster: Links, node size, compute time and model size.
        sync_period: BMUF's tau (local steps per block).
        sync_buffers: Model-sized buffers a BMUF block sync averages (model + Adam m, v: 3;
            SGD with momentum: 2; moments kept local or reset: 1).

    Raises:
        ValueError: For an unknown ``algo`` or a bad layout.
    """
    k, nodes = layout(p, cluster.ranks_per_node)
    n, c = cluster.model_bytes, cluster.compute_s
    intra, inter = cluster.intra, cluster.inter
    if algo == "ssgd":
        comm = hierarchical_allreduce(n, p, cluster.ranks_per_node, intra, inter)
        return StepCost(c + comm, c, comm)
    if algo in ("bmuf", "bmuf-ov", "bmuf-ov-int8"):
        if sync_period < 1:
            raise ValueError(f"sync_period must be >= 1, got {sync_period}")
        m = sync_buffers * n * (INT8_WIRE_RATIO if algo == "bmuf-ov-int8" else 1.0)
        block = ring_allreduce(m, nodes, inter) + ring_allgather(m, k, intra) if nodes > 1 else 0.0
        base = c + ring_allreduce(n, k, intra)
        if algo == "bmuf":
            return StepCost(base + block / sync_period, c, base - c + block / sync_period)
        # Overlapped: the block's mean runs during the next tau steps; only what does not fit
        # in them is waited for.
        exposed = max(0.0, block - sync_period * base) / sync_period
        return StepCost(base + exposed, c, base - c + exposed, block)
    if algo == "h-adpsgd":
        base = c + ring_allreduce(n, k, intra)
        if nodes == 1:  # one super-learner: nobody to gossip with
            return StepCost(base, c, base - c)
        exchange = pair_exchange(n, inter)
        bcast = broadcast(n, k, intra)
        # T = base + e * bcast with e = min(1, T / exchange): one exchange per step when the
        # exchange fits in a step, else as many as the gossip thread completes.
        total = base + bcast
        if total < exchange:  # then bcast < exchange too: the denominator is positive
            total = base / (1 - bcast / exchange)
        rate = min(1.0, total / exchange)
        return StepCost(total, c, total - c, exchange, rate)
    if algo == "adpsgd":
        if p == 1:
            return StepCost(c, c, 0.0)
        if nodes == 1:
            exchange = pair_exchange(n, intra)
        else:
            # Rounds alternate in-node pairs and node-straddling pairs; a straddling round puts
            # one exchange towards each neighbour node on the interface (2n each way).
            exchange = (pair_exchange(n, intra) + pair_exchange(2 * n, inter)) / 2
        return StepCost(c, c, 0.0, exchange, min(1.0, c / exchange) if exchange else 1.0)
    raise ValueError(f"unknown algorithm {algo!r}; the model knows {', '.join(ALGOS)}")


def speedup(algo: str, p: int, cluster: Cluster, **kw: int) -> float:
    """``p * T(1) / T(p)``: throughput at ``p`` learners over one learner's (1 at ``p = 1``)."""
    one = step_time(algo, 1, cluster, **kw).total_s
    return p * one / step_time(algo, p, cluster, **kw).total_s


# ---------------------------------------------------------------------------- fitting
def fit_alpha_beta(latency_coeff: Sequence[float], byte_coeff: Sequence[float],
                   times: Sequence[float], relative: bool = True) -> Link:
    """Least-squares ``alpha, beta`` of ``time ~= alpha * latency_coeff + beta * byte_coeff``.

    Each row is one measurement: for a ring allreduce over ``p`` ranks of ``n`` bytes the
    coefficients are ``2 (p - 1)`` and ``2 (p - 1) / p * n``; for a pair exchange 1 and ``n``.

    Args:
        latency_coeff: Multiplier of ``alpha`` per row.
        byte_coeff: Multiplier of ``beta`` per row.
        times: Measured seconds per row.
        relative: Minimise relative rather than absolute errors. Sizes span many orders of
            magnitude; without the weighting the largest messages decide alone and ``alpha``
            comes out as noise (often negative).

    Returns:
        The fitted link; a coefficient the unconstrained fit makes negative is pinned at 0 and
        the other refitted (a negative latency or bandwidth has no meaning).

    Raises:
        ValueError: With fewer than two rows, mismatched lengths, or non-positive times.
    """
    a = np.column_stack([np.asarray(latency_coeff, float), np.asarray(byte_coeff, float)])
    t = np.asarray(times, float)
    if a.shape[0] != t.shape[0] or a.shape[0] < 2:
        raise ValueError(f"need >= 2 rows of equal length, got {a.shape[0]} and {t.shape[0]}")
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("times must be finite and > 0")
    w = 1.0 / t if relative else np.ones_like(t)
    aw, tw = a * w[:, None], t * w
    coef = np.linalg.lstsq(aw, tw, rcond=None)[0]
    if np.any(coef < 0):
        best = None
        for keep in (0, 1):
            col = aw[:, keep]
            value = float(col @ tw / (col @ col)) if col @ col > 0 else 0.0
            cand = np.zeros(2)
            cand[keep] = max(value, 0.0)
            err = float(np.sum((aw @ cand - tw) ** 2))
            if best is None or err < best[0]:
                best = (err, cand)
        coef = best[1]  # type: ignore[index]
    return Link(alpha=float(coef[0]), beta=float(coef[1]))


def ring_coefficients(sizes: Sequence[float], ranks: Sequence[int]) -> tuple[list[float],
                                                                               list[float]]:
    """Latency and byte coefficients of ring allreduces (sizes in bytes, rank counts per row)."""
    lat = [2.0 * (p - 1) for p in ranks]
    byt = [2.0 * (p - 1) / p * n for n, p in zip(sizes, ranks, strict=True)]
    return lat, byt


def fit_error(link: Link, latency_coeff: Sequence[float], byte_coeff: Sequence[float],
              times: Sequence[float]) -> float:
    """Root-mean-square relative error of ``link``'s predictions over the rows."""
    pred = link.alpha * np.asarray(latency_coeff) + link.beta * np.asarray(byte_coeff)
    t = np.asarray(times, float)
    return float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
