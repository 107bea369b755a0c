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
- **Compressed deltas** (``--wire bf16|int8|int4|topk``): what travels is the block's progress
  ``theta_local - theta_init`` (and ``m - m_init`` for the corrected moments), small and
  centred, compressed with error feedback (:mod:`hadpsgd.comm.codec`); the mean is
  added back to the references, which are identical on every node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hadpsgd.algorithms.bmuf.moments import BlockMoments, Layout, Slots
from hadpsgd.comm.side import Job

Flat = dict[torch.dtype, torch.Tensor]
"""One flat tensor per dtype, in the layout of the model's flat parameter buffers."""


@dataclass
class BlockAverage:
    """A fragment's block average: in flight, or arrived and not yet filtered."""

    tau: int
    """Local steps of the block being averaged."""
    packs: Flat
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
    average: BlockAverage | None = None
    """Its block average in flight or not yet filtered (overlapped), else None."""
    ids: set[int] = field(default_factory=set)
    """``id`` of its parameters (for Adam's per-parameter ``k``)."""

    def due(self, tau: int) -> bool:
        """Whether its block ends with the step just taken."""
        return self.block_steps >= (self.first_block if self.num_syncs == 0
                                    and self.average is None else tau)

    def count_step(self) -> None:
        """One more local step: in its block, and since the block of its average ended."""
        self.block_steps += 1
        if self.average is not None:
            self.average.since += 1

    def restart(self) -> None:
        """Back to the start of the schedule (BMUF starts or restarts)."""
        self.rho, self.block_steps, self.num_syncs, self.average = 0.0, 0, 0, None

    def state_dict(self) -> dict[str, Any]:
        """Its schedule and filter counters (its average: see :meth:`BlockFilter.state_dict`)."""
        return {"block_steps": self.block_steps, "rho": self.rho, "num_syncs": self.num_syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (no average pending)."""
        self.block_steps, self.rho = int(state["block_steps"]), float(state["rho"])
        self.num_syncs, self.average = int(state["num_syncs"]), None


def split(layout: Layout, order: list[torch.nn.Parameter], count: int,
          tau: int) -> list[Fragment]:
    """Cut the parameters (in flat-buffer ``order``) into ``count`` fragments of ~equal size.

    ``count <= tau`` is an option's limit (:class:`BMUFOptions`); the model's is checked here.

    Raises:
        ValueError: If there are fewer parameters than fragments.
    """
    if count > len(order):
        raise ValueError(f"--bmuf-fragments {count} is more than the model's {len(order)} "
                         "parameter tensors; use at most that many fragments")
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


class BlockFilter:
    """The block filter's state and its two operations on a fragment: launch and apply.

    It owns theta_n (``global_model``), theta_init_n (``start_point``) and Delta_n
    (``delta``) of the whole model, flat per dtype like the parameters, and filters them
    fragment by fragment: :meth:`launch` packs what a fragment's block end sends,
    :meth:`apply` filters the average into those and into the local model and moments.

    Args:
        params: The local flat parameters per dtype (the algorithm's buffers).
        moments: The optimizer's moment treatment.
        eta: Block momentum.
        zeta: Block learning rate.
        nesterov: Nesterov (start at ``theta_n + eta * Delta_n``) or classical.
        compressed: The packs hold progress since the block's start, not values (a
            compressed wire).
    """

    def __init__(self, params: Flat, moments: BlockMoments, eta: float, zeta: float,
                 nesterov: bool, compressed: bool) -> None:
        self.params, self.moments = params, moments
        self.eta, self.zeta, self.nesterov, self.compressed = eta, zeta, nesterov, compressed
        self.global_model: Flat = {}
        """theta_n per dtype (what is evaluated and deployed)."""
        self.start_point: Flat = {}
        """theta_init_n per dtype."""
        self.delta: Flat = {}
        """Delta_n per dtype."""

    def start(self) -> None:
        """Begin (again) at the current local model: theta = theta_init = it, Delta = 0."""
        for dtype, buf in self.params.items():
            self.global_model[dtype] = buf.clone()
            self.start_point[dtype] = buf.clone()
            self.delta[dtype] = torch.zeros_like(buf)

    def launch(self, frag: Fragment, overlap: bool) -> BlockAverage:
        """End ``frag``'s block: pack what is averaged (and, overlapped, what to re-base on).

        The pack is the fragment's local model and sent moments, or with a compressed wire
        their progress since the block's start (``theta - theta_init``, ``m - m_init``).
        The result is also ``frag.average``.
        """
        moments = self.moments
        tau, frag.block_steps = frag.block_steps, 0
        packs: Flat = {}
        snaps: dict[torch.dtype, list[torch.Tensor]] | None = {} if overlap else None
        segments = 1 + len(moments.sent_keys)
        for dtype, (lo, hi) in frag.spans.items():
            n = hi - lo
            local = self.params[dtype][lo:hi]
            pack = torch.empty(segments * n, dtype=dtype, device=local.device)
            parts = list(pack.split(n))
            parts[0].copy_(local)
            moments.pack(dtype, parts[1:], frag.slots[dtype], lo)
            if self.compressed:
                parts[0].sub_(self.start_point[dtype][lo:hi])
                if moments.strategy == "corrected" and moments.sent_keys:
                    for part, init in zip(parts[1:], moments.init[dtype], strict=True):
                        part.sub_(init[lo:hi])
            packs[dtype] = pack
            if snaps is not None:
                snaps[dtype] = [local.clone(), *moments.snapshot(dtype, frag.slots[dtype], lo, n)]
        frag.average = BlockAverage(tau, packs, snaps)
        return frag.average

    def apply(self, frag: Fragment) -> None:
        """Filter ``frag``'s reduced average into theta / theta_init / Delta and its moments.

        Blocking, the local model starts the next block at theta_init_n; overlapped, it is
        re-based there, keeping the steps taken since the block ended. Clears
        ``frag.average``.
        """
        avg, moments, eta = frag.average, self.moments, self.eta
        assert avg is not None and avg.job is None, "apply a reduced average"
        rho_prev = frag.rho
        frag.rho = eta * frag.rho + avg.tau
        # The next block starts eta * rho mini-batches beyond the average (see BMUF.rho).
        eta_rho = eta * (frag.rho if self.nesterov else rho_prev)
        for dtype, (lo, hi) in frag.spans.items():
            parts = list(avg.packs[dtype].split(hi - lo))
            bar, init = parts[0], self.start_point[dtype][lo:hi]
            delta, glob = self.delta[dtype][lo:hi], self.global_model[dtype][lo:hi]
            if not self.compressed:
                bar.sub_(init)                               # theta_bar - theta_init_{n-1}
            if self.compressed and moments.strategy == "corrected" and moments.sent_keys:
                for part, m_init in zip(parts[1:], moments.init[dtype], strict=True):
                    part.add_(m_init[lo:hi])                 # m_bar = m_init + mean progress
            delta.mul_(eta).add_(bar, alpha=self.zeta)       # Delta_n
            glob.add_(delta)                                 # theta_n
            init.copy_(glob)
            if self.nesterov:
                init.add_(delta, alpha=eta)                  # theta_n + eta * Delta_n
            local = self.params[dtype][lo:hi]
            snaps = avg.snaps[dtype] if avg.snaps is not None else None
            if snaps is None:
                local.copy_(init)                            # the next block starts here
            else:
                local.add_(init - snaps[0])                  # re-based: the steps since are kept
            moments.apply(dtype, parts[1:], avg.tau, eta_rho, frag.slots[dtype], lo,
                          snaps[1:] if snaps is not None else None, avg.since)
        moments.finish(eta_rho, frag.ids, avg.since)
        frag.num_syncs += 1
        frag.average = None

    def state_dict(self, fragments: list[Fragment]) -> dict[str, Any]:
        """theta, theta_init, Delta, and every fragment's counters and reduced average.

        The averages must have arrived (the same on every learner); what they are re-based
        on is per super-learner (:meth:`node_snaps`).
        """
        def flat(d: Flat) -> dict[str, torch.Tensor]:
            return {str(k): v.clone() for k, v in d.items()}

        return {"global_model": flat(self.global_model), "start_point": flat(self.start_point),
                "delta": flat(self.delta),
                "fragments": [f.state_dict() for f in fragments],
                "pending": {f.index: {"tau": f.average.tau, "since": f.average.since,
                                      "packs": flat(f.average.packs)}
                            for f in fragments if f.average is not None}}

    def load_state_dict(self, state: dict[str, Any], fragments: list[Fragment]) -> None:
        """Restore :meth:`state_dict` (of a checkpoint of one fragment too)."""
        saved = state.get("fragments") or [{"block_steps": state["block_steps"],
                                            "rho": state["rho"], "num_syncs": state["num_syncs"]}]
        for frag, s in zip(fragments, saved, strict=True):
            frag.load_state_dict(s)
        for index, p in state.get("pending", {}).items():
            frag = fragments[int(index)]
            frag.average = BlockAverage(int(p["tau"]), self._here(p["packs"], frag.spans),
                                        since=int(p["since"]))
        for name in ("global_model", "start_point", "delta"):
            target: Flat = getattr(self, name)
            target.clear()
            target.update(self._here(state[name], self.params))

    def node_snaps(self, fragments: list[Fragment]) -> dict[int, list[list[torch.Tensor]]]:
        """Per fragment with an overlapped average: the local state it is re-based on."""
        return {f.index: [[t.clone() for t in ts] for ts in f.average.snaps.values()]
                for f in fragments if f.average is not None and f.average.snaps}

    def load_node_snaps(self, snaps: dict[Any, list[list[torch.Tensor]]],
                        fragments: list[Fragment]) -> None:
        """Restore :meth:`node_snaps` (after the averages, :meth:`load_state_dict`)."""
        for index, saved in snaps.items():
            frag = fragments[int(index)]
            assert frag.average is not None, "the pending mean is restored first"
            frag.average.snaps = {
                dtype: [t.to(self.params[dtype].device, dtype) for t in ts]
                for dtype, ts in zip(frag.spans, saved, strict=True)}

    def _here(self, saved: dict[str, torch.Tensor], dtypes: Any) -> Flat:
        """Saved flat tensors (keyed by dtype name) on this process's devices, per dtype."""
        return {dtype: saved[str(dtype)].to(self.params[dtype].device, dtype).clone()
                for dtype in dtypes if str(dtype) in saved}


__all__ = ["BlockAverage", "BlockFilter", "Fragment", "split"]
