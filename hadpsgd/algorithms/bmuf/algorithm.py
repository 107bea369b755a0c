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

from hadpsgd.algorithms.base import Algorithm
from hadpsgd.algorithms.bmuf.checkpoint import BlockCheckpoint
from hadpsgd.algorithms.bmuf.exchange import BlockExchange
from hadpsgd.algorithms.bmuf.filter import BlockFilter, Fragment, split
from hadpsgd.algorithms.bmuf.moments import BlockMoments, Layout
from hadpsgd.algorithms.bmuf.options import (
    DEFAULT_SYNC_PERIOD,
    MODEL_RESIDUAL_UP_TO,
    SHARE_CHUNK,
    BMUFOptions,
)
from hadpsgd.algorithms.gradsync import GradCheck
from hadpsgd.algorithms.registry import register
from hadpsgd.comm import World
from hadpsgd.comm.codec import FORMATS, SPARSE_WIRES, wire_spec
from hadpsgd.comm.overlap import GradScope


def default_block_momentum(worker_lr: str, num_workers: int) -> float:
    """Eta such that a steady block update is N blocks at the single learner's rate.

    In the steady state the filter amplifies the averaged block update by ``1 / (1 - eta)``
    (Eq. 4: rho_n -> tau / (1 - eta)); a worker at r times the single learner's rate needs
    ``1 - r / N`` for N workers: ``1 - 1/N`` (the BMUF papers) at the single rate (r = 1),
    0 (plain model averaging) at the global rate (r = N).
    """
    return 0.0 if worker_lr == "global" else 1.0 - 1.0 / num_workers


@register("bmuf", "blockwise model-update filtering with block momentum every tau steps, "
                  "and the Adam moment correction (BMUF-Adam)")
class BMUF(BlockCheckpoint, Algorithm):
    """Blockwise model-update filtering with block momentum over super-learners (nodes).

    Every step averages the gradients inside the node (a super-learner is synchronous) and
    takes the local optimizer step. Every ``sync_period`` local steps, the super-learners'
    models (and, for ``corrected``/``average``, the optimizer's moment buffers) are averaged
    in one message per dtype and filtered with block momentum; see the module docstring.

    The model's buffers (BatchNorm's statistics; ``sync_buffers``): their floating-point
    ones are averaged inside the super-learner after every step (its learners see different
    batches, as they do gradients), and across the super-learners at every block sync of
    the last fragment (every ``sync_period`` steps, and the closing one of :meth:`finish`),
    blocking and unfiltered: the plain mean of every learner's, written back as the start
    of the next block and kept with theta_n as the global model's buffers. Integer buffers
    (``num_batches_tracked``) are rank 0's at those syncs. During the warm-up they are rank
    0's after every step, as under SSGD.

    Args:
        model: The local replica.
        optimizer: Any ``torch.optim`` optimizer over ``model``'s parameters (SGD with or
            without momentum, Adam, AdamW, ...).
        topo: The communication topology; nodes must be of equal size.
        options: :class:`BMUFOptions` (their fields say what each does), or as keywords:
            ``sync_period`` (tau), ``block_momentum`` (eta in [0, 1); None means ``1 - 1/N``
            for ``N = topo.num_nodes``), ``block_lr`` (zeta), ``nesterov``, ``adam_moments``
            (see :mod:`hadpsgd.algorithms.bmuf.moments`), ``warmup_steps``,
            ``warmup_moments``, ``block_overlap`` (see :mod:`hadpsgd.algorithms.bmuf.filter`),
            ``fragments``, ``wire``; and the shared ones of :class:`Algorithm`
            (``max_grad_norm``: of the node-averaged gradient).

    Raises:
        hadpsgd.cli.ConfigError: For an option out of range (a ``ValueError``).
        hadpsgd.comm.TopologyError: If the nodes are of unequal size.
    """

    separate_eval_model = True
    needs_equal_nodes = True
    Options = BMUFOptions
    options: BMUFOptions
    divergence_hint = ("BMUF's block momentum amplifies each block's update up to N times, "
                       "and --bmuf-worker-lr global steps every worker at the world's rate; "
                       "use the defaults (--optimizer and --adam-moments unset), the BMUF-Adam "
                       "recipe (--optimizer adam), a smaller --lr, or a smaller "
                       "--block-momentum. ")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: World,
                 **options: Any) -> None:
        super().__init__(model, optimizer, topo, **options)
        opts = self.options
        self.eta = default_block_momentum(opts.worker_lr, topo.num_nodes) if (
            opts.block_momentum is None) else float(opts.block_momentum)
        """The block momentum in use: ``block_momentum``, or its default for ``worker_lr``."""
        self.tau = opts.tau(topo.num_nodes)
        """The block length in use: ``sync_period``, or its default for the workers."""
        opts.check_fragments(self.tau)
        self.warmup_lr = opts.warmup_rate(topo.num_nodes)
        """The synchronous warm-up's rate in use: ``warmup_lr``, or its default."""
        self.residual = opts.residual_mode(topo.num_nodes)
        """Where a compressed sync's rounding goes: ``residual``, or its default."""
        self.keep = opts.keep(self.residual)
        """The share of the rounding taken back into the model (``residual`` model)."""
        self.share = opts.share(self.tau)
        """A sparse wire's share in use: ``topk_fraction``, or its default for the block
        (None on a dense wire)."""
        self.started = False
        """Whether BMUF runs (False during the synchronous warm-up)."""
        self._agreed: list[torch.Tensor] | None = None
        """The buffers' mean at the last block sync: the global model's (``sync_buffers``)."""
        self._saved_layout: list[list[Any]] | None = None
        """The flat order of the state loaded last, where it is not this process's."""
        self.moments = BlockMoments(optimizer, opts.adam_moments, self._layout())
        self.moments.floor_second_moment = opts.wire != "fp32"
        self.filter = BlockFilter(self.params.buffers, self.moments, self.eta,
                                  float(opts.block_lr), opts.nesterov, opts.wire != "fp32")
        self.fragments: list[Fragment] = split(self.moments.layout, list(self.params.params),
                                               opts.fragments, self.tau)
        self.exchange = BlockExchange(topo, wire_spec(opts.wire, self.share), opts.block_overlap,
                                      segments=1 + len(self.moments.sent_keys))
        if topo.num_nodes == 1 and topo.size > 1 and topo.rank == 0:
            warnings.warn(
                f"bmuf with a single super-learner (all {topo.size} learners on one node) is "
                "synchronous SGD: there is nothing to filter. BMUF's workers are the nodes; "
                "set --ranks-per-node 1 for one worker per rank (per GPU, as in the BMUF-Adam "
                "paper) or --ranks-per-node K for workers of K ranks.",
                RuntimeWarning, stacklevel=2)
        for said in (opts.long_block_warning(topo.num_nodes),
                     opts.many_nodes_warning(topo.num_nodes)):
            if said and topo.rank == 0:
                warnings.warn(said, RuntimeWarning, stacklevel=2)
        if opts.warmup_steps == 0:
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

    @property
    def wire_bytes(self) -> int:
        """Payload bytes this rank sent across nodes in block syncs."""
        return self.exchange.bytes_sent

    def internode_bytes(self) -> tuple[int, int]:
        """The warm-up's gradients and the block syncs, sent and received across nodes."""
        sent, received = super().internode_bytes()
        return sent + self.exchange.bytes_sent, received + self.exchange.bytes_received

    # ------------------------------------------------------------------ helpers
    def _layout(self) -> Layout:
        layout: Layout = {}
        for p, off in self.param_offsets():
            layout.setdefault(p.dtype, []).append((p, off))
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
        self.filter.start()
        for frag in self.fragments:
            frag.restart()
        self.moments.start()
        self.started = True
        if self.syncs_buffers:  # every learner's are rank 0's here (construction, warm-up)
            self._agreed = self.buffers.copy()

    def wait_in_flight(self) -> None:
        """Wait for every background block average in flight.

        Before anything that reads what they change, or reduces on their communicator from
        this thread (so the collectives stay matched); benchmarks time it.
        """
        for frag in self.fragments:
            self.exchange.wait(frag.average)

    # ------------------------------------------------------------------ steps
    def reduces_world(self) -> bool:
        """Only in the synchronous warm-up (``--bmuf-warmup-steps``); blocks are node-local."""
        return self.options.warmup_steps > 0

    def grad_scope(self) -> GradScope:
        """The node mean (the super-learner) once BMUF runs; all learners' during warm-up."""
        if not self.started:
            return "world"  # warm-up: plain synchronous SGD over every learner
        return "node" if self.topo.local_size > 1 else None

    def apply_update(self, check: GradCheck) -> bool:
        """The optimizer step; in a ``world``-rate warm-up, at SSGD's rate for the world's batch.

        The warm-up averages every learner's gradient, a batch N super-learners large; at the
        worker's single-learner rate (``--bmuf-worker-lr single``) each of its steps would
        move the model as far as one step of one worker, and the paper's warm-up (a single
        learner on ~10 % of the data) makes N times that progress on the same data.
        """
        factor = self._warmup_rate_factor()
        if factor == 1.0:
            return super().apply_update(check)
        groups = self.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * factor
        try:
            return super().apply_update(check)
        finally:  # the loop's schedule owns the rate: BMUF's workers step at it
            for group, rate in zip(groups, rates, strict=True):
                group["lr"] = rate

    def _warmup_rate_factor(self) -> float:
        """World batch over the update batch in a ``world``-rate warm-up, else 1."""
        if self.started or self.warmup_lr != "world":
            return 1.0
        return self.topo.size / self.update_batch(1)

    def after_step(self) -> None:
        """End the warm-up when due; a fragment's block sync when its block ends."""
        if not self.started:
            super().after_step()  # warm-up is SSGD: the buffers become rank 0's
            if self.steps >= self.options.warmup_steps:
                self._start(reset_moments=self.options.warmup_moments == "reset")
            return
        if self.syncs_buffers:  # the super-learner's learners agree, as on their gradient
            self.buffers.mean("node")
        for frag in self.fragments:
            frag.count_step()
            if frag.due(self.tau):
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
            if frag.average is not None:
                self._apply(frag)
            if frag.block_steps > 0:
                self._sync_fragment(frag, blocking=True)

    def finish_changes_state(self) -> bool:
        """Whether a block is partial or a mean is pending: :meth:`finish` would close it."""
        return self.started and any(f.block_steps or f.average is not None
                                    for f in self.fragments)

    def steps_not_deployed(self) -> int:
        """The steps since the oldest block the global model has not taken in.

        Per fragment: the steps of its block in flight, and, with a mean still in flight
        or not yet filtered (``--bmuf-overlap``), that block's steps too; the most of any
        fragment (with ``--bmuf-fragments`` the others have taken in some of them: their
        chunks are then retrained on top of what they hold). The warm-up's replicas are
        the global model.
        """
        if not self.started:
            return 0
        return max(f.block_steps + (f.average.tau if f.average is not None else 0)
                   for f in self.fragments)

    def carry_bytes(self, old: Algorithm) -> None:
        """The gradients' counters and the block syncs' (sent and received)."""
        super().carry_bytes(old)
        if isinstance(old, BMUF):
            self.exchange.bytes_sent += old.exchange.bytes_sent
            self.exchange.bytes_received += old.exchange.bytes_received

    def _sync_fragment(self, frag: Fragment, blocking: bool = False) -> None:
        """End ``frag``'s block: apply its previous average if one is due, send this one.

        Blocking (the default without ``--bmuf-overlap``), the average is filtered at once:
        one message per dtype holding the model (or its progress) and the sent moments. The
        closing sync of :meth:`finish` ends a short block: ``tau`` is the number of local
        steps actually taken, in rho's recursion and in Eq. 18 alike.
        """
        if frag.average is not None:
            self._apply(frag)  # overlapped: the previous block's mean, one block late
        overlap = self.options.block_overlap and not blocking and self.topo.num_nodes > 1
        self.exchange.send(frag, self.filter.launch(frag, overlap), background=overlap)
        if not overlap:
            self._apply(frag)
        if self.syncs_buffers and frag is self.fragments[-1]:
            # A few kilobytes, blocking: a mean of node-identical buffers (see the class).
            self.buffers.mean("nodes")
            self._agreed = self.buffers.copy()

    def _apply(self, frag: Fragment) -> None:
        """Filter ``frag``'s average once it has arrived.

        With ``--bmuf-residual model`` the worker then takes back what its sync did not send
        (the wire's rounding of its delta): its next block starts from the new start point
        plus that, so its next delta carries it once, and nothing it learned is redone.
        """
        self.exchange.wait(frag.average)
        self.filter.apply(frag)
        if self.residual == "model":
            for dtype, (lo, hi) in frag.spans.items():
                self.exchange.move_model_residual_(frag.index, dtype,
                                                   self.params.buffers[dtype][lo:hi],
                                                   self.keep)

    def defaults_note(self) -> str:
        """The block and the rounding's place where the workers chose them (not the user)."""
        opts, n = self.options, self.topo.num_nodes
        said = []
        if opts.sync_period is None:
            said.append(f"{opts.flag('sync_period')} {self.tau} (the default for {n} "
                        f"worker{'s' if n != 1 else ''})")
        if opts.topk_fraction is None and self.share != FORMATS[opts.wire].fraction:
            k = round(self.share * SHARE_CHUNK)
            said.append(f"{opts.flag('topk_fraction')} {self.share!r} ({k} of {SHARE_CHUNK:,} "
                        f"a sync: the bytes a step of the wire's default at a block of "
                        f"{DEFAULT_SYNC_PERIOD})")
        if opts.residual is None and opts.wire in SPARSE_WIRES:
            form = ("kept in each worker's model" if self.residual == "model"
                    else "error feedback")
            said.append(f"{opts.flag('residual')} {self.residual}: the rounding of --wire "
                        f"{opts.wire} {form} (model up to {MODEL_RESIDUAL_UP_TO} workers, "
                        "delta above)")
        if opts.residual_keep is None and self.residual == "model" and self.keep != 1.0:
            said.append(f"{opts.flag('residual_keep')} {self.keep}: that share of each "
                        "worker's rounding taken back into its model, the rest error feedback")
        return f"bmuf: {'; '.join(said)}" if said else ""

    def evaluation_note(self) -> str:
        """The evaluated model is the initial one while no block sync has happened yet.

        Said after steps but before the first sync, so a long block (tau 40) does not look
        like a run that does not learn.
        """
        synced = any(f.num_syncs for f in self.fragments)
        if self.started and self.block_steps > 0 and not synced:
            return (f" (the global model before any block sync: the first comes after "
                    f"{self.tau} steps, --sync-period)")
        return ""

    def metrics(self) -> dict[str, float]:
        """Bytes sent across nodes in block syncs so far (this rank), and the syncs.

        ``block_syncs``: the block syncs of the whole model so far (every fragment's);
        ``hadpsgd.plot`` marks where they grew.
        """
        return {**super().metrics(), "wire_bytes": float(self.wire_bytes),
                "block_syncs": float(min(f.num_syncs for f in self.fragments))}

    def update_batch(self, per_learner: int) -> int:
        """The batch the rate is scaled to: one super-learner's, or the world's.

        ``worker_lr`` single: the BMUF paper keeps the single learner's learning rate on
        every worker, and block momentum accounts for the rest. global: every worker steps
        at SSGD's rate for the world's batch, and the block sync averages (block momentum 0
        by default). The optional SSGD warm-up runs at this rate, or at the world's
        (``warmup_lr``).
        """
        if self.options.worker_lr == "global":
            return super().update_batch(per_learner)  # the world's batch, as SSGD's
        return per_learner * self.topo.local_size

    def restart_from_model(self) -> None:
        """A new filter from the loaded weights: theta = theta_init = them, Delta = 0."""
        if self.started:
            self._start()

    @contextlib.contextmanager
    def evaluation_parameters(self) -> Iterator[nn.Module]:
        """The model holds the global model theta_n inside; local parameters come back after.

        With ``sync_buffers`` its buffers are the mean of the last block sync (the local ones
        come back after, too).
        """
        if not self.started:  # warm-up: the replicas are the (synchronous) global model
            yield self.model
            return
        saved = {dtype: buf.clone() for dtype, buf in self.params.buffers.items()}
        agreed = (self.buffers.swapped(self._agreed) if self._agreed is not None
                  else contextlib.nullcontext())
        try:
            for dtype, buf in self.params.buffers.items():
                buf.copy_(self.filter.global_model[dtype])
            with agreed:
                yield self.model
        finally:
            for dtype, buf in self.params.buffers.items():
                buf.copy_(saved[dtype])

    def close(self) -> None:
        """Wait for a background mean in flight and stop the side channel's thread."""
        try:
            self.wait_in_flight()
        finally:
            self.exchange.close()
        super().close()
