"""BMUF's block filter, fragment by fragment: blocking, or applied one block late (overlapped).

The filter of :mod:`hadpsgd.algorithms.bmuf` (Eq. 1-9 and the moment correction, Eq. 13-18)
is element-wise, so it can run on parts of the model at different times.

- **Fragments** (``--bmuf-fragments F``, as in Streaming DiLoCo): the parameters are cut into
  ``F`` groups of whole, consecutive parameters of about equal size; fragment ``f`` ends its
  first block after ``(f + 1) * tau // F`` steps and every ``tau`` steps after, so the syncs
  are staggered through the block and each carries ``1/F`` of the model: the link's peak
  traffic drops ``F`` times. Each fragment keeps its own ``rho`` (Eq. 4) and Adam's ``k`` of
  its own parameters moves with it.
- **Overlap** (``--bmuf-overlap``): at the end of a fragment's block its local model and
  moments are sent to a background reduction (:class:`hadpsgd.comm.side.SideChannel`) and
  training goes on from the *local* model; one block later the average has arrived and is
  filtered exactly as a blocking sync would (same ``Delta``, ``theta``, start point, moments),
  and then the local state is *re-based*: the steps taken meanwhile are kept, on top of the
  filtered start point instead of the old local model, ``theta_local += theta_init_n -
  snapshot``, and for each moment buffer (an exponential average with decay ``beta``)
  ``m += beta**d * (m_init_n - m_snapshot)`` after ``d`` steps, which is what those ``d``
  steps would have made of ``m_init_n``. The block deltas that enter the filter are the
  local progress of each block; only the points where the gradients were taken differ from
  the blocking run (one block stale).
- **Compressed deltas** (``--wire bf16|int8``): what travels is the block's progress
  ``theta_local - theta_init`` (and ``m - m_init`` for the corrected moments), small and
  centred, compressed with error feedback (:mod:`hadpsgd.comm.compressed`); the mean is
  added back to the references, which are identical on every node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hadpsgd.algorithms.bmuf_moments import BlockMoments, Layout, Slots
from hadpsgd.comm.side import Job


@dataclass
class Pending:
    """A fragment's block average in flight (or arrived, not yet applied)."""

    tau: int
    """Local steps of the block being averaged."""
    packs: dict[torch.dtype, torch.Tensor]
    """Per dtype: the sent model (or its delta) and moments; the mean once reduced."""
    snaps: dict[torch.dtype, list[torch.Tensor]] | None = None
    """Overlap: the local model and every moment buffer at the block's end, to re-base on."""
    job: Job | None = None
    """The background reduction (None once waited for)."""
    since: int = 0
    """Local steps taken since the block ended."""


@dataclass
class Fragment:
    """Whole, consecutive parameters synced together, and their place in the schedule."""

    index: int
    slots: dict[torch.dtype, Slots]
    """Per dtype: its parameters and their offsets in the dtype's flat buffer."""
    spans: dict[torch.dtype, tuple[int, int]]
    """Per dtype: the fragment's contiguous element range ``[lo, hi)`` in the flat buffer."""
    first_block: int
    """Steps of its first block (its syncs are staggered through the block)."""
    block_steps: int = 0
    """Local steps since its last sync."""
    rho: float = 0.0
    """rho_n of its own blocks (Eq. 4)."""
    num_syncs: int = 0
    """Its block averages applied so far."""
    pending: Pending | None = None
    ids: set[int] = field(default_factory=set)
    """``id`` of its parameters (for Adam's per-parameter ``k``)."""

    def due(self, tau: int) -> bool:
        """Whether its block ends with the step just taken."""
        return self.block_steps >= (self.first_block if self.num_syncs == 0
                                    and self.pending is None else tau)


def split(layout: Layout, order: list[torch.nn.Parameter], count: int,
          tau: int) -> list[Fragment]:
    """Cut the parameters (in flat-buffer ``order``) into ``count`` fragments of ~equal size.

    Raises:
        ValueError: If there are fewer parameters than fragments, or ``count > tau``.
    """
    if count > len(order):
        raise ValueError(f"--bmuf-fragments {count} is more than the model's {len(order)} "
                         "parameter tensors; use at most that many fragments")
    if count > tau:
        raise ValueError(f"--bmuf-fragments {count} is more than --sync-period {tau}: the "
                         "fragments' syncs are staggered one or more steps apart; use at most "
                         f"{tau} fragments or a longer period")
    where = {id(p): (dtype, off) for dtype, slots in layout.items() for p, off in slots}
    total = sum(p.numel() for p in order)
    groups: list[list[torch.nn.Parameter]] = [[]]
    done = 0
    for i, p in enumerate(order):
        left_params, left_groups = len(order) - i, count - len(groups) + 1
        # Close the group at its share of the elements, or when each later group needs one.
        if groups[-1] and len(groups) < count and (
                done >= total * len(groups) / count or left_params < left_groups):
            groups.append([])
        groups[-1].append(p)
        done += p.numel()
    fragments = []
    for f, members in enumerate(groups):
        slots: dict[torch.dtype, Slots] = {}
        for p in members:
            dtype, off = where[id(p)]
            slots.setdefault(dtype, []).append((p, off))
        spans = {d: (s[0][1], s[-1][1] + s[-1][0].numel()) for d, s in slots.items()}
        fragments.append(Fragment(f, slots, spans, first_block=(f + 1) * tau // count,
                                  ids={id(p) for p in members}))
    return fragments


def launch(frag: Fragment, params: dict[torch.dtype, torch.Tensor],
           start_point: dict[torch.dtype, torch.Tensor], moments: BlockMoments,
           compressed: bool, overlap: bool) -> Pending:
    """End ``frag``'s block: pack what is averaged (and, overlapped, what to re-base on).

    The pack is the fragment's local model and sent moments, or with a compressed wire
    their progress since the block's start (``theta - theta_init``, ``m - m_init``).
    """
    tau, frag.block_steps = frag.block_steps, 0
    packs: dict[torch.dtype, torch.Tensor] = {}
    snaps: dict[torch.dtype, list[torch.Tensor]] | None = {} if overlap else None
    segments = 1 + len(moments.sent_keys)
    for dtype, (lo, hi) in frag.spans.items():
        n = hi - lo
        local = params[dtype][lo:hi]
        pack = torch.empty(segments * n, dtype=dtype, device=local.device)
        parts = list(pack.split(n))
        parts[0].copy_(local)
        moments.pack(dtype, parts[1:], frag.slots[dtype], lo)
        if compressed:
            parts[0].sub_(start_point[dtype][lo:hi])
            if moments.strategy == "corrected" and moments.sent_keys:
                for part, init in zip(parts[1:], moments.init[dtype], strict=True):
                    part.sub_(init[lo:hi])
        packs[dtype] = pack
        if snaps is not None:
            snaps[dtype] = [local.clone(), *moments.snapshot(dtype, frag.slots[dtype], lo, n)]
    return Pending(tau, packs, snaps)


def apply(frag: Fragment, pending: Pending, filt: dict[str, dict[torch.dtype, torch.Tensor]],
          params: dict[torch.dtype, torch.Tensor], moments: BlockMoments, eta: float,
          zeta: float, nesterov: bool, compressed: bool) -> None:
    """Filter ``frag``'s averaged block into theta / theta_init / Delta and its moments.

    Args:
        frag: The fragment.
        pending: Its reduced block average (``packs`` hold the means).
        filt: ``global_model``, ``start_point`` and ``delta``, flat per dtype.
        params: The local flat parameters per dtype.
        moments: The optimizer's moment treatment.
        eta: Block momentum.
        zeta: Block learning rate.
        nesterov: Nesterov (start at ``theta_n + eta * Delta_n``) or classical.
        compressed: The packs hold progress since the block's start, not values.
    """
    rho_prev = frag.rho
    frag.rho = eta * frag.rho + pending.tau
    # The next block starts eta * rho mini-batches beyond the average (see BMUF._block_sync).
    eta_rho = eta * (frag.rho if nesterov else rho_prev)
    for dtype, (lo, hi) in frag.spans.items():
        n = hi - lo
        parts = list(pending.packs[dtype].split(n))
        bar, init = parts[0], filt["start_point"][dtype][lo:hi]
        delta, glob = filt["delta"][dtype][lo:hi], filt["global_model"][dtype][lo:hi]
        if not compressed:
            bar.sub_(init)                               # theta_bar - theta_init_{n-1}
        if compressed and moments.strategy == "corrected" and moments.sent_keys:
            for part, m_init in zip(parts[1:], moments.init[dtype], strict=True):
                part.add_(m_init[lo:hi])                 # m_bar = m_init + mean progress
        delta.mul_(eta).add_(bar, alpha=zeta)            # Delta_n
        glob.add_(delta)                                 # theta_n
        init.copy_(glob)
        if nesterov:
            init.add_(delta, alpha=eta)                  # theta_n + eta * Delta_n
        local = params[dtype][lo:hi]
        snaps = pending.snaps[dtype] if pending.snaps is not None else None
        if snaps is None:
            local.copy_(init)                            # the next block starts here
        else:
            local.add_(init - snaps[0])                  # re-based: the steps since are kept
        moments.apply(dtype, parts[1:], pending.tau, eta_rho, frag.slots[dtype], lo,
                      snaps[1:] if snaps is not None else None, pending.since)
    moments.finish(eta_rho, frag.ids, pending.since)
    frag.num_syncs += 1


def state_of(frag: Fragment) -> dict[str, Any]:
    """A fragment's schedule and filter counters (its pending mean: see BMUF.state_dict)."""
    return {"block_steps": frag.block_steps, "rho": frag.rho, "num_syncs": frag.num_syncs}


__all__ = ["Fragment", "Pending", "apply", "launch", "split", "state_of"]
