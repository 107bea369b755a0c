"""BMUF and BMUF-Adam: blockwise model-update filtering across super-learners.

See docs/design.md, "BMUF in paper form".

Paper form (bmuf-adam, Eq. 1-9): the global model ``theta_n`` and the start point of the next
block ``theta_init_n`` are stored separately. At block sync ``n``, with ``N`` super-learners::

    theta_bar    = mean over super-learners of the local models
    Delta_n      = eta * Delta_{n-1} + zeta * (theta_bar - theta_init_{n-1})
    theta_n      = theta_{n-1} + Delta_n                 # evaluated and checkpointed
    theta_init_n = theta_n + eta * Delta_n  (Nesterov)  |  theta_n  (classical)

with ``theta_init_0 = theta_0`` the initial (broadcast, or warmed-up) model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hadpsgd.algorithms import bmuf_filter
from hadpsgd.algorithms.base import Algorithm, register
from hadpsgd.algorithms.bmuf_filter import Fragment, Pending
from hadpsgd.algorithms.bmuf_moments import BlockMoments, Layout
from hadpsgd.algorithms.bmuf_options import BMUFOptions
from hadpsgd.comm import Topology
from hadpsgd.comm.overlap import Scope


@register("bmuf", "blockwise model-update filtering with block momentum every tau steps, "
                  "and the Adam moment correction (BMUF-Adam)")
class BMUF(Algorithm):
    """Blockwise model-update filtering with block momentum over super-learners (nodes).

    Every step averages the gradients inside the node (a super-learner is synchronous) and
    takes the local optimizer step. Every ``sync_period`` local steps, the super-learners'
    models (and, for ``corrected``/``average``, the optimizer's moment buffers) are averaged
    in one message per dtype and filtered with block momentum; see the module docstring.

    Args:
        model: The local replica.
        optimizer: Any ``torch.optim`` optimizer over ``model``'s parameters (SGD with or
            without momentum, Adam, AdamW, ...).
        topo: The communication topology; nodes must be of equal size.
        sync_period: Local steps per block (tau).
        block_momentum: eta in [0, 1); None means ``1 - 1/N`` for ``N = topo.num_nodes``.
        block_lr: zeta > 0.
        nesterov: Nesterov block momentum (default) or classical.
        adam_moments: ``corrected`` (Eq. 18), ``average`` (Eq. 13), ``local`` or ``reset``;
            see :mod:`hadpsgd.algorithms.bmuf_moments`.
        warmup_steps: Steps of synchronous SGD over all learners before BMUF starts (from the
            warmed model, with ``Delta = 0``).
        warmup_moments: ``keep`` the warmed moment buffers (and Adam's ``k``) when BMUF starts,
            or ``reset`` them to a fresh optimizer's.
        block_overlap: Average each block in the background and apply it one block later,
            re-based (see :mod:`hadpsgd.algorithms.bmuf_filter`).
        fragments: Sync the model in this many staggered fragments.
        wire: ``fp32``, ``bf16`` or ``int8`` (block progress, with error feedback).
        max_grad_norm: Clip the node-averaged gradient to this L2 norm; 0 disables.

    Raises:
        ValueError: For an option out of range.
        hadpsgd.comm.TopologyError: If the nodes are of unequal size.
    """

    separate_eval_model = True
    Options = BMUFOptions
    divergence_hint = ("BMUF's block momentum amplifies each block's update about N times; "
                       "use the BMUF-Adam recipe (the default: no --optimizer and "
                       "--adam-moments), --adam-moments reset with SGD, or a smaller "
                       "--block-momentum. ")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology,
                 sync_period: int = 8, block_momentum: float | None = None,
                 block_lr: float = 1.0, nesterov: bool = True, adam_moments: str = "corrected",
                 warmup_steps: int = 0, warmup_moments: str = "keep", block_overlap: bool = False,
                 fragments: int = 1, wire: str = "fp32", max_grad_norm: float = 0.0,
                 **common: Any) -> None:
        # Every rank raises alike, before the first collective, so nobody is left waiting.
        BMUFOptions(sync_period=sync_period, block_momentum=block_momentum,
                    block_lr=block_lr, nesterov=nesterov, adam_moments=adam_moments,
                    bmuf_warmup_steps=warmup_steps, bmuf_warmup_moments=warmup_moments,
                    bmuf_overlap=block_overlap, bmuf_fragments=fragments, wire=wire)
        topo.require_equal_nodes("bmuf")
        super().__init__(model, optimizer, topo, max_grad_norm=max_grad_norm, **common)
        if fragments > len(self.params.params):
            raise ValueError(f"--bmuf-fragments {fragments} is more than the model's "
                             f"{len(self.params.params)} parameter tensors; use at most that many")
        self.sync_period = sync_period
        self.block_momentum = (1.0 - 1.0 / topo.num_nodes if block_momentum is None
                               else float(block_momentum))
        self.block_lr = float(block_lr)
        self.nesterov = nesterov
        self.warmup_steps = warmup_steps
        self.warmup_moments = warmup_moments
        self.block_overlap = block_overlap
        self.num_fragments = fragments
        self.wire = wire
        self.started = False
        """Whether BMUF runs (False during the synchronous warm-up)."""
        self.global_model: dict[torch.dtype, torch.Tensor] = {}
        """theta_n per dtype (flat, in the layout of ``self.params``)."""
        self.start_point: dict[torch.dtype, torch.Tensor] = {}
        """theta_init_n per dtype."""
        self.delta: dict[torch.dtype, torch.Tensor] = {}
        """Delta_n per dtype."""
        self.wire_bytes = 0
        """Payload bytes this rank sent across nodes in block syncs (fp32 without a side
        channel: a ring allreduce's share of the hierarchical reduction)."""
        self.moments = BlockMoments(optimizer, adam_moments, self._layout())
        self.moments.floor_second_moment = wire != "fp32"
        self.fragments: list[Fragment] = bmuf_filter.split(
            self.moments.layout, list(self.params.params), fragments, sync_period)
        # A private channel for background or compressed means (collective: every rank).
        self.side = (topo.side_channel(wire, background=block_overlap)
                     if block_overlap or wire != "fp32" else None)
        if topo.num_nodes == 1 and topo.size > 1 and topo.rank == 0:
            warnings.warn(
                f"bmuf with a single super-learner (all {topo.size} learners on one node) is "
                "synchronous SGD: there is nothing to filter. BMUF's workers are the nodes; "
                "set --ranks-per-node 1 for one worker per rank (per GPU, as in the BMUF-Adam "
                "paper) or --ranks-per-node K for workers of K ranks.",
                RuntimeWarning, stacklevel=2)
        if warmup_steps == 0:
            self._start()

    # ------------------------------------------------------------------ counters
    @property
    def block_steps(self) -> int:
        """Local steps since the last block sync (of the last fragment, on tau's schedule)."""
        return self.fragments[-1].block_steps

    @property
    def num_syncs(self) -> int:
        """Block syncs applied (n; of the last fragment, whose blocks are tau steps long)."""
        return self.fragments[-1].num_syncs

    @property
    def rho(self) -> float:
        """rho_n = eta * rho_{n-1} + tau: mini-batches equivalent to Delta_n (Eq. 4)."""
        return self.fragments[-1].rho

    # ------------------------------------------------------------------ helpers
    def _layout(self) -> Layout:
        layout: Layout = {}
        offsets: dict[torch.dtype, int] = {}
        for p in self.params.params:
            off = offsets.get(p.dtype, 0)
            layout.setdefault(p.dtype, []).append((p, off))
            offsets[p.dtype] = off + p.numel()
        return layout

    def _start(self, reset_moments: bool = False) -> None:
        """BMUF begins here: theta = theta_init = the current model, Delta = 0, rho = 0.

        Args:
            reset_moments: Zero the optimizer's moment buffers and Adam's ``k`` first (the
                ``reset`` choice after a warm-up).
        """
        self.wait_in_flight()
        if reset_moments:
            self.moments.reset_optimizer()
        for dtype, buf in self.params.buffers.items():
            self.global_model[dtype] = buf.clone()
            self.start_point[dtype] = buf.clone()
            self.delta[dtype] = torch.zeros_like(buf)
        for frag in self.fragments:
            frag.rho, frag.block_steps, frag.num_syncs, frag.pending = 0.0, 0, 0, None
        self.moments.start()
        self.started = True

    def wait_in_flight(self) -> None:
        """Wait for every background block average in flight.

        Before anything that reads what they change, or reduces on their communicator from
        this thread (so the collectives stay matched); benchmarks time it.
        """
        for frag in self.fragments:
            if frag.pending is not None and frag.pending.job is not None:
                self.side.wait(frag.pending.job)  # type: ignore[union-attr]
                frag.pending.job = None

    # ------------------------------------------------------------------ steps
    def grad_scope(self) -> Scope:
        """The node mean (the super-learner) once BMUF runs; all learners' during warm-up."""
        if not self.started:
            return "world"  # warm-up: plain synchronous SGD over every learner
        return "node" if self.topo.local_size > 1 else None

    def after_step(self) -> None:
        """End the warm-up when due; a fragment's block sync when its block ends."""
        if not self.started:
            if self.steps >= self.warmup_steps:
                self._start(reset_moments=self.warmup_moments == "reset")
            return
        for frag in self.fragments:
            frag.block_steps += 1
            if frag.pending is not None:
                frag.pending.since += 1
            if frag.due(self.sync_period):
                self._sync_fragment(frag)

    def sync(self) -> None:
        """Nothing: evaluation and checkpoints never cut a block short.

        The global model theta_n is kept apart (it is what is evaluated and deployed), and
        :meth:`state_dict` resumes mid-block, so the trajectory does not depend on
        ``--checkpoint-every`` or on when the run is stopped and resumed.
        """

    def finish(self) -> None:
        """End of training: apply what is in flight, then close partial blocks, blocking.

        No trained step is lost: an overlapped average is applied (re-based), then each
        fragment's steps since its last sync are averaged and filtered at once.
        """
        if not self.started:
            return
        # Every background mean first: the closing syncs below reduce on the same private
        # communicator from this thread, and two threads' collectives on one communicator
        # could be matched in different orders on different ranks.
        self.wait_in_flight()
        for frag in self.fragments:
            if frag.pending is not None:
                self._apply(frag)
            if frag.block_steps > 0:
                self._sync_fragment(frag, blocking=True)

    def _sync_fragment(self, frag: Fragment, blocking: bool = False) -> None:
        """End ``frag``'s block: apply its previous average if one is due, send this one.

        Blocking (the default without ``--bmuf-overlap``), the average is filtered at once:
        one message per dtype holding the model (or its progress) and the sent moments. The
        closing sync of :meth:`finish` ends a short block: ``tau`` is the number of local
        steps actually taken, in rho's recursion and in Eq. 18 alike.
        """
        if frag.pending is not None:
            self._apply(frag)  # overlapped: the previous block's mean, one block late
        overlap = self.block_overlap and not blocking and self.topo.num_nodes > 1
        compressed = self.wire != "fp32"
        pending = bmuf_filter.launch(frag, self.params.buffers, self.start_point,
                                     self.moments, compressed, overlap)
        frag.pending = pending
        if self.topo.num_nodes > 1:
            if overlap:
                pending.job = self.side.submit(  # type: ignore[union-attr]
                    lambda: self._reduce(frag.index, pending),
                    f"background block average of fragment {frag.index}")
            else:
                self._reduce(frag.index, pending)
        if not overlap:
            self._apply(frag)

    def _reduce(self, index: int, pending: Pending) -> None:
        """Average a fragment's packs across super-learners (identical inside each node)."""
        for dtype, pack in pending.packs.items():
            if self.side is not None:
                before = self.side.bytes_sent
                for key, part in self._wire_parts(index, dtype, pack).items():
                    self.side.mean_(key, part)
                self.wire_bytes += self.side.bytes_sent - before
            else:
                # Identical inside each node (synchronous super-learner), so the cross-node
                # average is bit-identical on every learner; so is all arithmetic after it.
                self.topo.inter_allreduce_(pack, op="avg")
                n = self.topo.num_nodes
                self.wire_bytes += (2 * (n - 1) * pack.numel() * pack.element_size()
                                    // (n * self.topo.local_size))

    def _apply(self, frag: Fragment) -> None:
        pending = frag.pending
        assert pending is not None
        if pending.job is not None:
            self.side.wait(pending.job)  # type: ignore[union-attr]
            pending.job = None
        bmuf_filter.apply(frag, pending, {"global_model": self.global_model,
                                          "start_point": self.start_point, "delta": self.delta},
                          self.params.buffers, self.moments, self.block_momentum,
                          self.block_lr, self.nesterov, self.wire != "fp32")
        frag.pending = None

    def metrics(self) -> dict[str, float]:
        """Bytes sent across nodes in block syncs so far (this rank)."""
        return {"wire_bytes": float(self.wire_bytes)}

    def update_batch(self, per_learner: int) -> int:
        """A local step averages one super-learner's batch.

        The BMUF paper keeps the single learner's learning rate on every worker; block
        momentum accounts for the rest. (The optional SSGD warm-up runs at this rate too.)
        """
        return per_learner * self.topo.local_size

    def restart_from_model(self) -> None:
        """A new filter from the loaded weights: theta = theta_init = them, Delta = 0."""
        if self.started:
            self._start()

    @contextlib.contextmanager
    def evaluation_parameters(self) -> Iterator[nn.Module]:
        """The model holds the global model theta_n inside; local parameters come back after."""
        if not self.started:  # warm-up: the replicas are the (synchronous) global model
            yield self.model
            return
        saved = {dtype: buf.clone() for dtype, buf in self.params.buffers.items()}
        try:
            for dtype, buf in self.params.buffers.items():
                buf.copy_(self.global_model[dtype])
            yield self.model
        finally:
            for dtype, buf in self.params.buffers.items():
                buf.copy_(saved[dtype])

    def close(self) -> None:
        """Wait for a background mean in flight and stop the side channel's thread."""
        if self.side is not None:
            try:
                self.wait_in_flight()
            finally:
                self.side.close()
                self.side = None
        super().close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything to resume mid-block: the filter, counters, moments and optimizer.

        Adam's ``k`` is the optimizer's own ``state["step"]`` (in ``optimizer``); the local
        parameters are the model's (the trainer saves ``model.state_dict()``). An overlapped
        mean in flight is waited for: the mean is the same on every learner and saved here,
        what it is re-based on is per super-learner (:meth:`node_state`).
        """
        self.wait_in_flight()
        state = super().state_dict()

        def flat(d: dict[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {str(k): v.clone() for k, v in d.items()}

        state["bmuf"] = {
            "started": self.started, "block_steps": self.block_steps,
            "num_syncs": self.num_syncs, "rho": self.rho,
            "global_model": flat(self.global_model), "start_point": flat(self.start_point),
            "delta": flat(self.delta), "moments": self.moments.state_dict(),
            "fragments": [bmuf_filter.state_of(f) for f in self.fragments],
            "pending": {f.index: {"tau": f.pending.tau, "since": f.pending.since,
                                  "packs": flat(f.pending.packs)}
                        for f in self.fragments if f.pending is not None},
            "wire_bytes": self.wire_bytes,
            "options": {"sync_period": self.sync_period, "block_momentum": self.block_momentum,
                        "block_lr": self.block_lr, "nesterov": self.nesterov,
                        "adam_moments": self.moments.strategy,
                        "warmup_steps": self.warmup_steps,
                        "warmup_moments": self.warmup_moments, "overlap": self.block_overlap,
                        "fragments": self.num_fragments, "wire": self.wire},
        }
        return state

    def node_state(self) -> dict[str, Any] | None:
        """Mid-block, each super-learner's own local model and optimizer state.

        At a block boundary (or on one node) every learner holds the same, and rank 0's
        state in the checkpoint is everyone's: nothing extra is saved. With an overlapped
        mean pending or a compressed wire, the local state at the block's end and the
        wire's rounding errors are per super-learner too.
        """
        if not self.started or self.topo.num_nodes == 1:
            return None
        self.wait_in_flight()  # the wire's rounding errors change while a mean is in flight
        pending = {f.index: [[t.clone() for t in ts] for ts in f.pending.snaps.values()]
                   for f in self.fragments if f.pending is not None and f.pending.snaps}
        mid_block = any(f.block_steps for f in self.fragments)
        if not (mid_block or pending or self.side is not None):
            return None
        return {"params": {str(d): b.clone() for d, b in self.params.buffers.items()},
                "optimizer": self.optimizer.state_dict(), "snaps": pending,
                "wire": self.side.state_dict() if self.side is not None else {}}

    def load_node_state(self, state: dict[str, Any]) -> None:
        """This super-learner's local model, optimizer state and overlapped/wire state."""
        for dtype, buf in self.params.buffers.items():
            buf.copy_(state["params"][str(dtype)].to(buf.device, buf.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        for index, snaps in state.get("snaps", {}).items():
            frag = self.fragments[int(index)]
            assert frag.pending is not None, "the pending mean is restored first"
            frag.pending.snaps = {
                dtype: [t.to(self.params.buffers[dtype].device, dtype) for t in ts]
                for dtype, ts in zip(frag.spans, snaps, strict=True)}
        if self.side is not None and state.get("wire"):
            self.side.load_state_dict(state["wire"], self._wire_keys())

    def _wire_parts(self, index: int, dtype: torch.dtype,
                    pack: torch.Tensor) -> dict[str, torch.Tensor]:
        """A pack as the side channel sends it: whole in fp32; compressed, one part per segment.

        The model's progress and each moment's differ in scale by orders of magnitude; a
        compressed wire scales each part on its own, so no quantisation chunk mixes them.
        """
        if self.wire == "fp32":
            return {f"fragment{index}-{dtype}": pack}
        segments = 1 + len(self.moments.sent_keys)
        return {f"fragment{index}-{dtype}-{i}": part
                for i, part in enumerate(pack.split(pack.numel() // segments))}

    def _wire_keys(self) -> dict[str, torch.Tensor]:
        """Each compressed tensor's key and shape (as :meth:`_reduce` names them)."""
        segments = 1 + len(self.moments.sent_keys)
        out: dict[str, torch.Tensor] = {}
        for f in self.fragments:
            for dtype, (lo, hi) in f.spans.items():
                like = torch.empty(segments * (hi - lo), dtype=dtype,
                                   device=self.params.buffers[dtype].device)
                out.update(self._wire_parts(f.index, dtype, like))
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (load the model's local parameters separately)."""
        super().load_state_dict(state)
        b = state["bmuf"]
        was = b.get("options", {})
        # What is in flight was packed for one fragment layout and one wire: refuse another.
        for name, flag_, now in (("fragments", "--bmuf-fragments", self.num_fragments),
                                 ("wire", "--wire", self.wire)):
            then = was.get(name, 1 if name == "fragments" else "fp32")
            if then != now:
                raise ValueError(f"the checkpoint's BMUF state was written with {flag_} {then} "
                                 f"(now {now}); resume with {flag_} {then}")
        self.started = bool(b["started"])
        saved = b.get("fragments") or [{"block_steps": b["block_steps"], "rho": b["rho"],
                                        "num_syncs": b["num_syncs"]}]
        for frag, s in zip(self.fragments, saved, strict=True):
            frag.block_steps, frag.rho = int(s["block_steps"]), float(s["rho"])
            frag.num_syncs, frag.pending = int(s["num_syncs"]), None
        for index, p in b.get("pending", {}).items():
            frag = self.fragments[int(index)]
            frag.pending = Pending(int(p["tau"]), {
                dtype: p["packs"][str(dtype)].to(self.params.buffers[dtype].device, dtype)
                for dtype in frag.spans}, since=int(p["since"]))
        self.wire_bytes = int(b.get("wire_bytes", 0))
        for name, target in (("global_model", self.global_model),
                             ("start_point", self.start_point), ("delta", self.delta)):
            target.clear()
            for dtype, buf in self.params.buffers.items():
                if str(dtype) in b[name]:
                    target[dtype] = b[name][str(dtype)].to(buf.device, buf.dtype).clone()
        self.moments.load_state_dict(b["moments"])
