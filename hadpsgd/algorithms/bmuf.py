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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hadpsgd.algorithms.base import AlgoOptions, Algorithm, register
from hadpsgd.algorithms.bmuf_moments import STRATEGIES, BlockMoments, Layout
from hadpsgd.cli import ConfigError, flag
from hadpsgd.comm import Topology
from hadpsgd.comm.overlap import Scope

WARMUP_MOMENTS: tuple[str, ...] = ("keep", "reset")


@dataclass
class BMUFOptions(AlgoOptions):
    """BMUF / BMUF-Adam options (the one place they are defined and checked)."""

    sync_period: int = 8
    """BMUF: local steps per block (tau) between two block syncs across super-learners."""
    block_momentum: float | None = None
    """BMUF: block momentum eta in [0, 1) (default 1 - 1/N for N super-learners, so 0 for
    one node)."""
    block_lr: float = 1.0
    """BMUF: block learning rate zeta (> 0; the paper uses 1)."""
    nesterov: bool = True
    """BMUF: Nesterov block momentum (the next block starts at theta_n + eta * Delta_n);
    --no-nesterov for classical block momentum (it starts at theta_n)."""
    adam_moments: str = field(default="corrected", metadata={"choices": STRATEGIES})
    """BMUF: optimizer moment buffers at a block sync: corrected (the paper's Eq. 18, with
    fractional Adam step), average (Eq. 13), local (kept) or reset (zeroed). SGD's momentum
    buffer is treated the same way with beta = --momentum. Default: corrected with Adam/AdamW,
    reset with SGD (corrected extrapolates SGD's unnormalised buffer and diverged on real
    speech; see docs/results.md)."""
    bmuf_warmup_steps: int = 0
    """BMUF: synchronous SGD over all learners for this many steps, then BMUF starts from the
    warmed model with Delta = 0."""
    bmuf_warmup_moments: str = field(default="keep", metadata={"choices": WARMUP_MOMENTS})
    """BMUF: the optimizer's moment buffers when BMUF starts after --bmuf-warmup-steps: keep
    the warmed buffers (and Adam's step k) or reset them to a fresh optimizer's (the paper
    leaves this open)."""

    recipe_help = ("--algo bmuf defaults to the BMUF-Adam paper's recipe: --optimizer adam "
                   "--beta1 0.5 --adam-moments corrected; with --optimizer sgd, --adam-moments "
                   "reset.")

    @classmethod
    def recipe(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """BMUF-Adam (Adam, beta1 0.5, corrected moments) unless the user chose otherwise.

        With SGD the momentum buffer is reset at each block sync (the measured best; the
        corrected extrapolation diverges on real speech).
        """
        optimizer = given.get("optimizer", "adam")
        adam = optimizer in ("adam", "adamw")
        out = {"optimizer": optimizer, "adam_moments": "corrected" if adam else "reset"}
        if adam:
            out["beta1"] = 0.5  # the paper's choice for BMUF-Adam (section 2.2)
        return {k: v for k, v in out.items() if k not in given}

    def __post_init__(self) -> None:
        if self.sync_period < 1:
            raise ConfigError(f"{flag('sync_period')} must be > 0, got {self.sync_period}")
        if self.block_momentum is not None and not 0.0 <= self.block_momentum < 1.0:
            raise ConfigError(f"{flag('block_momentum')} must be in [0, 1) (omit it for "
                              f"1 - 1/N), got {self.block_momentum}")
        if self.block_lr <= 0:
            raise ConfigError(f"{flag('block_lr')} must be > 0, got {self.block_lr}")
        if self.bmuf_warmup_steps < 0:
            raise ConfigError(f"{flag('bmuf_warmup_steps')} must be >= 0, got "
                              f"{self.bmuf_warmup_steps}")
        if self.bmuf_warmup_moments not in WARMUP_MOMENTS:
            raise ConfigError(f"{flag('bmuf_warmup_moments')} must be one of "
                              f"{', '.join(WARMUP_MOMENTS)}, got {self.bmuf_warmup_moments!r}")
        if self.adam_moments not in STRATEGIES:
            raise ConfigError(f"{flag('adam_moments')} must be one of {', '.join(STRATEGIES)}, "
                              f"got {self.adam_moments!r}")

    def algorithm_kwargs(self) -> dict[str, Any]:
        """The constructor's keywords (its warm-up keyword has no ``bmuf_`` prefix)."""
        return {"sync_period": self.sync_period, "block_momentum": self.block_momentum,
                "block_lr": self.block_lr, "nesterov": self.nesterov,
                "adam_moments": self.adam_moments, "warmup_steps": self.bmuf_warmup_steps,
                "warmup_moments": self.bmuf_warmup_moments}


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
                 warmup_steps: int = 0, warmup_moments: str = "keep",
                 max_grad_norm: float = 0.0, **common: Any) -> None:
        # Every rank raises alike, before the first collective, so nobody is left waiting.
        BMUFOptions(sync_period, block_momentum, block_lr, nesterov, adam_moments,
                    warmup_steps, warmup_moments)
        topo.require_equal_nodes("bmuf")
        super().__init__(model, optimizer, topo, max_grad_norm=max_grad_norm, **common)
        self.sync_period = sync_period
        self.block_momentum = (1.0 - 1.0 / topo.num_nodes if block_momentum is None
                               else float(block_momentum))
        self.block_lr = float(block_lr)
        self.nesterov = nesterov
        self.warmup_steps = warmup_steps
        self.warmup_moments = warmup_moments
        self.started = False
        """Whether BMUF runs (False during the synchronous warm-up)."""
        self.block_steps = 0
        """Local steps since the last block sync (or since BMUF started)."""
        self.num_syncs = 0
        """Block syncs done (n)."""
        self.rho = 0.0
        """rho_n = eta * rho_{n-1} + tau: mini-batches equivalent to Delta_n (Eq. 4)."""
        self.global_model: dict[torch.dtype, torch.Tensor] = {}
        """theta_n per dtype (flat, in the layout of ``self.params``)."""
        self.start_point: dict[torch.dtype, torch.Tensor] = {}
        """theta_init_n per dtype."""
        self.delta: dict[torch.dtype, torch.Tensor] = {}
        """Delta_n per dtype."""
        self._pack: dict[torch.dtype, torch.Tensor] = {}
        self.moments = BlockMoments(optimizer, adam_moments, self._layout())
        if topo.num_nodes == 1 and topo.size > 1 and topo.rank == 0:
            warnings.warn(
                f"bmuf with a single super-learner (all {topo.size} learners on one node) is "
                "synchronous SGD: there is nothing to filter. BMUF's workers are the nodes; "
                "set --ranks-per-node 1 for one worker per rank (per GPU, as in the BMUF-Adam "
                "paper) or --ranks-per-node K for workers of K ranks.",
                RuntimeWarning, stacklevel=2)
        if warmup_steps == 0:
            self._start()

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
        if reset_moments:
            self.moments.reset_optimizer()
        for dtype, buf in self.params.buffers.items():
            self.global_model[dtype] = buf.clone()
            self.start_point[dtype] = buf.clone()
            self.delta[dtype] = torch.zeros_like(buf)
        self.rho = 0.0
        self.block_steps = 0
        self.moments.start()
        self.started = True

    # ------------------------------------------------------------------ steps
    def grad_scope(self) -> Scope:
        """The node mean (the super-learner) once BMUF runs; all learners' during warm-up."""
        if not self.started:
            return "world"  # warm-up: plain synchronous SGD over every learner
        return "node" if self.topo.local_size > 1 else None

    def after_step(self) -> None:
        """End the warm-up when due; a block sync after every ``sync_period`` local steps."""
        if not self.started:
            if self.steps >= self.warmup_steps:
                self._start(reset_moments=self.warmup_moments == "reset")
            return
        self.block_steps += 1
        if self.block_steps >= self.sync_period:
            self._block_sync()

    def sync(self) -> None:
        """Nothing: evaluation and checkpoints never cut a block short.

        The global model theta_n is kept apart (it is what is evaluated and deployed), and
        :meth:`state_dict` resumes mid-block, so the trajectory does not depend on
        ``--checkpoint-every`` or on when the run is stopped and resumed.
        """

    def finish(self) -> None:
        """End of training: close the last, partial block so no trained step is lost."""
        if self.started and self.block_steps > 0:
            self._block_sync()

    def _block_sync(self) -> None:
        """Average models (+ moments) across super-learners in one message, then filter.

        The closing sync of :meth:`finish` ends a short block: ``tau`` is the number of local
        steps actually taken, in rho's recursion and in Eq. 18 alike.

        The next block's start point lies ``eta * rho`` equivalent mini-batches beyond the
        average: Nesterov's ``theta_bar + eta * Delta_n`` (Eq. 9) adds ``eta * rho_n``; the
        classical start ``theta_n = theta_bar + eta * Delta_{n-1}`` (Eq. 6) adds
        ``eta * rho_{n-1}``. The moments (Eq. 16) and Adam's ``k`` move by that amount.
        """
        tau = self.block_steps
        eta, zeta = self.block_momentum, self.block_lr
        rho_prev = self.rho
        self.rho = eta * self.rho + tau
        eta_rho = eta * (self.rho if self.nesterov else rho_prev)
        segments = 1 + len(self.moments.sent_keys)
        for dtype, params in self.params.buffers.items():
            n = params.numel()
            pack = self._pack.get(dtype)
            if pack is None or pack.numel() != segments * n:
                pack = self._pack[dtype] = torch.empty(segments * n, dtype=dtype,
                                                       device=params.device)
            parts = list(pack.split(n))
            parts[0].copy_(params)
            self.moments.pack(dtype, parts[1:])
            if self.topo.num_nodes > 1:
                # Identical inside each node (synchronous super-learner), so the cross-node
                # average is bit-identical on every learner; so is all arithmetic below.
                self.topo.inter_allreduce_(pack, op="avg")
            bar, init = parts[0], self.start_point[dtype]
            delta, glob = self.delta[dtype], self.global_model[dtype]
            bar.sub_(init)                                   # theta_bar - theta_init_{n-1}
            delta.mul_(eta).add_(bar, alpha=zeta)            # Delta_n
            glob.add_(delta)                                 # theta_n
            init.copy_(glob)
            if self.nesterov:
                init.add_(delta, alpha=eta)                  # theta_n + eta * Delta_n
            params.copy_(init)                               # the next block starts here
            self.moments.apply(dtype, parts[1:], tau, eta_rho)
        self.moments.finish(eta_rho)
        self.block_steps = 0
        self.num_syncs += 1

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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything to resume mid-block: the filter, counters, moments and optimizer.

        Adam's ``k`` is the optimizer's own ``state["step"]`` (in ``optimizer``); the local
        parameters are the model's (the trainer saves ``model.state_dict()``).
        """
        state = super().state_dict()

        def flat(d: dict[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {str(k): v.clone() for k, v in d.items()}

        state["bmuf"] = {
            "started": self.started, "block_steps": self.block_steps,
            "num_syncs": self.num_syncs, "rho": self.rho,
            "global_model": flat(self.global_model), "start_point": flat(self.start_point),
            "delta": flat(self.delta), "moments": self.moments.state_dict(),
            "options": {"sync_period": self.sync_period, "block_momentum": self.block_momentum,
                        "block_lr": self.block_lr, "nesterov": self.nesterov,
                        "adam_moments": self.moments.strategy,
                        "warmup_steps": self.warmup_steps,
                        "warmup_moments": self.warmup_moments},
        }
        return state

    def node_state(self) -> dict[str, Any] | None:
        """Mid-block, each super-learner's own local model and optimizer state.

        At a block boundary (or on one node) every learner holds the same, and rank 0's
        state in the checkpoint is everyone's: nothing extra is saved.
        """
        if not self.started or self.block_steps == 0 or self.topo.num_nodes == 1:
            return None
        return {"params": {str(d): b.clone() for d, b in self.params.buffers.items()},
                "optimizer": self.optimizer.state_dict()}

    def load_node_state(self, state: dict[str, Any]) -> None:
        """This super-learner's local model and optimizer state, saved mid-block."""
        for dtype, buf in self.params.buffers.items():
            buf.copy_(state["params"][str(dtype)].to(buf.device, buf.dtype))
        self.optimizer.load_state_dict(state["optimizer"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (load the model's local parameters separately)."""
        super().load_state_dict(state)
        b = state["bmuf"]
        self.started = bool(b["started"])
        self.block_steps = int(b["block_steps"])
        self.num_syncs = int(b["num_syncs"])
        self.rho = float(b["rho"])
        for name, target in (("global_model", self.global_model),
                             ("start_point", self.start_point), ("delta", self.delta)):
            target.clear()
            for dtype, buf in self.params.buffers.items():
                if str(dtype) in b[name]:
                    target[dtype] = b[name][str(dtype)].to(buf.device, buf.dtype).clone()
        self.moments.load_state_dict(b["moments"])
