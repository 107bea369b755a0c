"""BMUF's options: the flags of ``--algo bmuf``, their help, recipe and validation.

Each option has one name: the field's, which is also the constructor's keyword, the
attribute of :attr:`BMUF.options` and the key of the checkpoint's saved options. Where that
name is too generic for the run's flags of every algorithm together, the field's metadata
gives the flag (``warmup_steps`` is ``--bmuf-warmup-steps``, see :func:`hadpsgd.cli.flag`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hadpsgd.algorithms.bmuf.moments import STRATEGIES
from hadpsgd.algorithms.options import WireOptions
from hadpsgd.cli import ConfigError
from hadpsgd.comm.codec import FORMATS, SPARSE_WIRES, WIRES, payload_bytes, wire_spec
from hadpsgd.comm.signtopk import SIGNTOPK_CHUNK

WARMUP_MOMENTS: tuple[str, ...] = ("keep", "reset")
LOSSY_WIRES: tuple[str, ...] = tuple(w for w in WIRES if w != "fp32")
"""The wires that round a sync (every one but fp32): where --bmuf-residual and
--bmuf-residual-keep are read."""
WORKER_LRS: tuple[str, ...] = ("single", "global")
WARMUP_LRS: tuple[str, ...] = ("worker", "world")
RESIDUALS: tuple[str, ...] = ("delta", "model")
ADAM_SLOW_LINK = ("--adam-moments local --bmuf-worker-lr global --block-momentum 0 "
                  "--max-grad-norm 1")
"""BMUF with Adam in the SGD recipe's shape: the best measured on a wire below 8 bits
(issue 57); not within SSGD's WER, so not a default, only named where BMUF-Adam on such a
wire is refused (:meth:`BMUFOptions.refuse_adam_on_a_lossy_wire`)."""
LOSSY_BELOW_BITS = 8.0
"""Wires of fewer bits a value (int4, sign, topk): a block longer than fp32's default costs
them far more than it costs fp32 at more than 4 workers (said at start,
:meth:`BMUFOptions.long_block_warning`), and BMUF-Adam on them has no recipe that held
Sync-Adam's WER (:meth:`BMUFOptions.refuse_adam_on_a_lossy_wire`)."""


DEFAULT_SYNC_PERIOD = 8
"""tau up to 4 workers, and the longest block a run gets without --sync-period."""


SINGLE_RATE_SHORTER_ABOVE = 8
"""Super-learners above which the single rate's block (BMUF-Adam's recipe) shortens too."""


def default_sync_period(worker_lr: str, num_workers: int) -> int:
    """Tau when the user gave none: shorter blocks for more workers.

    At the global rate every worker steps as SSGD does on 1/N of its batch, so the workers'
    models drift apart within a block more, the more there are; averaging them then loses
    more. Measured on speechocean762 (docs/results.md, *Continuous speech from 250 voices*):
    16 workers x 8 chunks at tau 8 ended 0.07 above SSGD's held-out loss and 1.9 WER points
    behind, at tau 4 0.02 above. 4 workers keep the tau 8 that matched SSGD on FSDD and
    speechocean. The single rate with block momentum (the BMUF papers', BMUF-Adam's recipe)
    keeps their 8 up to 8 workers and takes the same rule above: at 16 workers, with the
    warm-up at the world's rate, tau 4 was 1.74 +- 0.10 WER points better than 8 on
    speechocean762 (3 seeds: +0.35 against SSGD, where 8 was +2.09) and 0.2 better on FSDD's
    three folds (docs/results.md, *BMUF-Adam at 16 workers*).
    """
    above = 4 if worker_lr == "global" else SINGLE_RATE_SHORTER_ABOVE
    if num_workers <= above:
        return DEFAULT_SYNC_PERIOD
    return max(2, round(DEFAULT_SYNC_PERIOD * math.sqrt(4 / num_workers)))


WARMUP_LR_WORLD_ABOVE = 8
"""Super-learners above which the synchronous warm-up runs at the world's rate by default."""


def default_warmup_lr(num_workers: int) -> str:
    """The warm-up's rate when the user gave none: the world's past 8 workers.

    With block momentum 1 - 1/N the filter takes about N blocks to build up to the single
    learner's pace; at 16 workers that is over half of a short run's first epoch, and a
    warm-up at one worker's rate leaves the model there under-trained. Measured with
    BMUF-Adam (docs/results.md): world 2.5 WER points better than worker at 16 workers on
    FSDD, 4.2 and 3.2 on speechocean762 (seeds 0, 1); 1.7 worse at 8 on FSDD.
    """
    return "world" if num_workers > WARMUP_LR_WORLD_ABOVE else "worker"


MODEL_RESIDUAL_UP_TO = 4
"""Super-learners up to which a sparse wire keeps each worker's rounding in its model."""


SPARSE_CLOSEST_UP_TO = 4
"""Super-learners up to which a sparse wire was measured closest to SSGD's WER; above, the
start says what more nodes cost (:meth:`BMUFOptions.many_nodes_warning`)."""


def default_residual(wire: str, num_workers: int) -> str:
    """Where a worker's rounding goes when the user gave no ``--bmuf-residual``.

    A sparse wire (top-k, signtopk) up to 4 workers keeps it in the worker's model: with
    error feedback the unsent part is progress the worker, restarting from the global
    model, makes again and sends twice (at 4 workers error feedback was 2.5 WER points worse
    with top-k on FSDD's 9 runs, 0.47 with signtopk on speechocean762 over 3 seeds). Above,
    error feedback: on speechocean762 at 16 workers (signtopk, 48 of 4,096 at tau 4) it was
    3.8 and 6.0 points better after 8 epochs (seeds 0, 1; +1.24 against SSGD over 5 seeds
    where the model form was +5.6 over 2) and 4.3 after 2 (seed 1), at 8 workers 1.4 after 2
    (seed 1, a screen); likely sixteen workers
    each keeping its own unsent part drift apart where error feedback restarts every worker
    from the global model each block. Dense codes keep error feedback.
    Measured: docs/results.md, *The signs of the largest, their places packed*.
    """
    sparse = wire.partition(":")[0] in SPARSE_WIRES
    return "model" if sparse and num_workers <= MODEL_RESIDUAL_UP_TO else "delta"


SIGNTOPK_KEEP = 0.5
"""The share of a worker's signtopk rounding taken back into its model by default (the
model form); the rest stays error feedback."""


def default_keep(wire: str, residual: str) -> float:
    """The share of a worker's rounding it takes back into its model, where none was given.

    With the model form on ``signtopk``: :data:`SIGNTOPK_KEEP`. Taking it all back, each of
    4 workers restarted from the global model plus a rounding of norm ~0.9 (a block's update
    ~0.4) and the rare classes' frames lost recall (23 % against SSGD's 28); leaving half as
    error feedback (sent with the next delta, so nothing is lost) was 1.05 ± 0.20 WER points
    better on speechocean762 (4 nodes, 5 seeds, better on each; +0.37 ± 0.20 against SSGD
    over 6, rare-class recall 25 %), and against SSGD +0.31 ± 0.55 on FSDD's folds (15
    runs, 0.53 ± 0.42 behind all of it) and −0.14 ± 0.24 on espeak (5 seeds)
    (docs/results.md, *Half the rounding kept*). 1 on every other wire (measured whole)
    and meaningless with error feedback.
    """
    return SIGNTOPK_KEEP if wire == "signtopk" and residual == "model" else 1.0


SHARE_CHUNK = SIGNTOPK_CHUNK
"""Values of the chunk a sparse wire's share is counted in: both sparse codes' chunk
(``TOPK_CHUNK`` is the same; tests/unit/test_bmuf_config.py holds them together)."""


def default_share(wire: str, tau: int) -> float | None:
    """A sparse wire's share of each chunk when the user gave no ``--topk-fraction``.

    The wire's own default (signtopk 112 of 4,096, topk 64) was set for a block of 8
    steps, where it sends ~1,100x fewer bytes than SSGD fp32 over a run. A block sends once
    per tau steps, so at another tau the same share sends 8/tau times the bytes a step: at
    16 workers (tau 4) ~550x. So the default follows the block: the largest share of
    :data:`SHARE_CHUNK` whose sync costs at most tau/8 of the default's sync, i.e. the
    same bytes a step (signtopk: 46 at tau 4, 17 at tau 2, 76 at tau 6; measured at 16
    workers with 48 at tau 4, 1,025x: docs/results.md, *The signs of the largest*). None
    for a dense wire.
    """
    default = FORMATS[wire].fraction if wire in FORMATS else None
    if default is None or tau == DEFAULT_SYNC_PERIOD:
        return default
    budget = payload_bytes(SHARE_CHUNK, wire_spec(wire, default)) * tau / DEFAULT_SYNC_PERIOD
    lo, hi = 1, SHARE_CHUNK  # bytes grow with the share: the largest within the budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if payload_bytes(SHARE_CHUNK, wire_spec(wire, mid / SHARE_CHUNK)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo / SHARE_CHUNK


@dataclass(frozen=True)
class BMUFOptions(WireOptions):
    """BMUF / BMUF-Adam options (the one place they are defined and checked)."""

    sync_period: int | None = None
    """BMUF: local steps per block (tau) between two block syncs across super-learners
    (default: 8 up to 4 super-learners with --bmuf-worker-lr global, up to 8 with single,
    and round(8 * sqrt(4 / N)) for N above, at least 2: with global 6 at 8, either way 4 at
    16, 3 at 32; see default_sync_period)."""
    block_momentum: float | None = None
    """BMUF: block momentum eta in [0, 1) (default 1 - 1/N for N super-learners with
    --bmuf-worker-lr single, 0 with global: either way a block's filtered update is, in the
    steady state, N blocks of the single learner's rate, as SSGD's step is)."""
    worker_lr: str = field(default="single", metadata={"choices": WORKER_LRS,
                                                      "flag": "bmuf-worker-lr"})
    """BMUF: the rate every worker steps at: single (--lr scaled to one super-learner's
    batch, as a single learner would; block momentum makes up the rest: the BMUF papers) or
    global (--lr scaled to the world's batch, as SSGD steps; block momentum defaults to 0, so
    the block sync averages the models: Kaldi's parallel training, which multiplies the rate
    by the number of jobs). global is --algo bmuf's default with SGD; see docs/results.md."""
    block_lr: float = 1.0
    """BMUF: block learning rate zeta (> 0; the paper uses 1)."""
    nesterov: bool = True
    """BMUF: Nesterov block momentum (the next block starts at theta_n + eta * Delta_n);
    --no-nesterov for classical block momentum (it starts at theta_n)."""
    adam_moments: str = field(default="corrected", metadata={"choices": STRATEGIES})
    """BMUF: optimizer moment buffers at a block sync: corrected (the paper's Eq. 18, with
    fractional Adam step), average (Eq. 13), local (kept) or reset (zeroed). SGD's momentum
    buffer is treated the same way with beta = --momentum. Default with --algo bmuf:
    corrected with Adam/AdamW, local with SGD (a reset loses most of each block's momentum,
    and corrected extrapolates SGD's unnormalised buffer, which diverged on real speech; see
    docs/results.md). Constructed directly, the algorithm's default is corrected."""
    warmup_steps: int = field(default=0, metadata={"flag": "bmuf-warmup-steps"})
    """BMUF: synchronous SGD over all learners for this many steps, then BMUF starts from the
    warmed model with Delta = 0."""
    block_overlap: bool = field(default=False, metadata={"flag": "bmuf-overlap"})
    """BMUF: average each block across super-learners in the background while the next
    block computes, and apply the filter one block later, re-basing the local model and
    moments by the steps taken meanwhile (hides the link; gradients one block stale)."""
    fragments: int = field(default=1, metadata={"flag": "bmuf-fragments"})
    """BMUF: sync the model in this many fragments of whole parameters at staggered steps
    of the block (streaming), so each sync carries 1/F of the model (at most --sync-period
    and the number of parameter tensors)."""
    warmup_lr: str | None = field(default=None, metadata={"choices": WARMUP_LRS,
                                                             "flag": "bmuf-warmup-lr"})
    """BMUF: the rate of the synchronous warm-up (--bmuf-warmup-steps): worker (the rate
    BMUF's workers then keep) or world (SSGD's: --lr scaled to the world's batch, which
    the warm-up's averaged gradient is; with --bmuf-worker-lr single that is N times the
    worker's, as much progress a step as the paper's single-learner warm-up makes on the
    same data). The same with --bmuf-worker-lr global. Default: worker up to 8
    super-learners, world above (default_warmup_lr): on unseen voices with BMUF-Adam world
    was 2.5 WER points better at 16 workers on FSDD and 3.2-4.2 on speechocean762, where the
    block momentum's build-up is over half the first epoch, and 1.7 worse at 8 on FSDD
    (docs/results.md)."""
    warmup_moments: str = field(default="keep", metadata={"choices": WARMUP_MOMENTS,
                                                          "flag": "bmuf-warmup-moments"})
    """BMUF: the optimizer's moment buffers when BMUF starts after --bmuf-warmup-steps: keep
    the warmed buffers (and Adam's step k) or reset them to a fresh optimizer's (the paper
    leaves this open)."""
    residual: str | None = field(default=None, metadata={"choices": RESIDUALS,
                                                            "flag": "bmuf-residual"})
    """BMUF on a compressed --wire: where a worker's rounding error of a block sync goes.
    delta (error feedback): into its next block's delta, the worker restarting from the
    global model; model: kept in the worker's own model, which restarts from the global
    model plus what its sync did not send (the bifurcated local models of CSER, Xie et al.
    2020, without its periodic reset), so no worker redoes progress it made and the next
    sync sends it once. Only the model's part; a moment buffer's rounding stays error
    feedback. Default: model on a sparse wire (topk, signtopk) up to 4 super-learners,
    delta otherwise (default_residual: at 16 workers delta was 3.8-6.0 WER points better)."""
    residual_keep: float | None = field(default=None, metadata={"flag": "bmuf-residual-keep"})
    """BMUF with --bmuf-residual model: the share of a worker's rounding it takes back into
    its model after a sync (1: all of it); the rest stays error feedback, added to its next
    delta as it is sent, so nothing is sent twice or lost. Default: 0.5 on signtopk (1.05
    WER points better than 1 on speechocean762 at 4 workers), 1 on other wires
    (default_keep)."""
    sync_buffers: bool = True
    """Keep the model's buffers (BatchNorm's running statistics) in agreement: ssgd takes
    rank 0's after every step (DDP's broadcast_buffers), bmuf and adpsgd average the
    floating-point ones (integer ones: rank 0's); --no-sync-buffers leaves each learner its
    own (docs/api.md, Buffers)."""

    # --bmuf-residual is read by the compressed wires only (WireOptions.wire_readers).
    wire_readers: ClassVar[dict[str, tuple[str, ...]]] = {
        **WireOptions.wire_readers, "residual": LOSSY_WIRES, "residual_keep": LOSSY_WIRES}

    recipe_help = ("--algo bmuf defaults to SGD workers at the global rate with their momentum "
                   "kept and their gradient clipped, averaged every tau steps (--optimizer sgd "
                   "--bmuf-worker-lr global --adam-moments local --max-grad-norm 1, block "
                   "momentum 0), tau 8 up to 4 workers and round(8 sqrt(4/N)) above (4 at "
                   "16): SSGD's word error rate on unseen speakers at 1/tau of its "
                   "traffic; every --wire keeps that tau (--wire sign: ~250x fewer bytes "
                   "than SSGD fp32 at 4 workers, ~125x at 16, at its word error rate on "
                   "speechocean762; the longer blocks tuned on FSDD trailed there; a sparse "
                   "wire, topk or signtopk, keeps each worker's rounding in its own model up "
                   "to 4 workers, --bmuf-residual model, signtopk half of it, "
                   "--bmuf-residual-keep 0.5, and error feedback above, delta: "
                   "--wire signtopk ~1,100x, its share of each 4,096 following tau). "
                   "--optimizer adam gives the "
                   "BMUF-Adam paper's recipe (--beta1 0.5 --adam-moments corrected "
                   "--bmuf-worker-lr single, block momentum 1 - 1/N), tau 8 up to 8 "
                   "workers and round(8 sqrt(4/N)) above (4 at 16); each of its block "
                   "syncs also sends both moment buffers, 3x SGD's bytes at the same tau; "
                   "on wires below 8 bits it is refused unless --adam-moments is given (none "
                   "measured held Sync-Adam's WER; the refusal names the best).")

    @classmethod
    def recipe(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """The measured defaults of ``--algo bmuf``, for what the user left out.

        SGD (the default): every worker at the global rate, its momentum buffer kept over
        block syncs, block momentum 0 (from ``worker_lr``), the worker's gradient clipped to
        norm 1, which matched SSGD on unseen speakers at 4 and 16 workers. A reset buffer
        loses most of every block's momentum; the BMUF papers' single-learner rate with
        block momentum 1 - 1/N under-trained; a worker takes the world's rate on 1/N of its
        batch, which diverged at 16 workers unclipped (Kaldi's parallel training, which
        also multiplies the rate by the number of jobs, bounds each step with its
        max-change). Measured: docs/results.md, *BMUF on unseen human voices*.
        Every wire keeps the block of :func:`default_sync_period` (issue 57): on
        speechocean762 ``--wire sign`` at tau 40 (its recipe before, tuned on FSDD) trailed
        SSGD by 3.46 WER points at 4 workers and 24.8 at 16, at tau 8 it matched SSGD at 4.
        Adam or AdamW: the BMUF-Adam paper's recipe (beta1 0.5,
        corrected moments, the single learner's rate, block momentum 1 - 1/N).
        A sparse wire (``topk``, ``signtopk``) keeps the worker's rounding in its model up
        to 4 workers and error feedback above, with either optimizer: ``--bmuf-residual``'s
        own default (:func:`default_residual`), since the workers are known only at start.
        """
        optimizer = given.get("optimizer", "sgd")
        adam = optimizer in ("adam", "adamw")
        out: dict[str, Any] = {"optimizer": optimizer}
        if adam:
            cls.refuse_adam_on_a_lossy_wire(given)
            out.update(adam_moments="corrected", bmuf_worker_lr="single",
                       beta1=0.5)  # the paper's choice for BMUF-Adam (section 2.2)
        else:
            out.update(adam_moments="local", bmuf_worker_lr="global", max_grad_norm=1.0)
        return {k: v for k, v in out.items() if k not in given}

    @classmethod
    def recipe_line(cls, algo: str, optimizer: str, filled: Mapping[str, Any],
                    spell: Callable[[str, Any], str]) -> str | None:
        """The recipe's line; with Adam's corrected moments it also says what a sync sends.

        Every block sync of BMUF-Adam carries the model and both moment buffers: 3x
        SGD-BMUF's bytes, which "one model average every tau steps" would hide (issue 57).
        """
        line = super().recipe_line(algo, optimizer, filled, spell)
        if line is None or filled.get("adam_moments") != "corrected":
            return line
        return (f"{line}; each block sync sends the model and both of Adam's moment buffers, "
                "3 models every tau steps (tau 8 up to 8 workers, fewer above)")

    @classmethod
    def refuse_adam_on_a_lossy_wire(cls, given: Mapping[str, Any]) -> None:
        """Refuse BMUF-Adam on a wire below 8 bits a value unless the moments were chosen.

        Every sync of the recipe (corrected moments) sends the parameters and both of
        Adam's buffers through the wire: 3x SGD-BMUF's bytes at any tau. Measured (issue 57):
        a user's conv + GRU CTC model through :class:`hadpsgd.Distributed` on FSDD (4
        learners, 20 epochs, one seed) reached 73.1 % WER with ``wire="sign"`` against
        SSGD's 54.3 %; on FSDD's three folds (4 learners, 4 epochs, 3 seeds, 2026-12-05) the
        recipe on ``--wire sign`` trailed Sync-Adam by 6.1 points and the moments kept local
        in the recipe's shape by 6.5; the best measured, Adam in the SGD recipe's shape
        (:data:`ADAM_SLOW_LINK`: the moments kept on each worker, so only the model crosses,
        254x fewer bytes than SSGD fp32), by 2.1 over the 9 runs (its fp32 twin matched
        Sync-Adam, +0.2), 0.9 on the espeak set and 0.7 on speechocean762 (3 seeds each).
        None within the issue's 0.5, so the run stops before any work;
        ``--adam-moments`` given says the user chose what travels (docs/usage.md, *Adam on
        a slow link*).

        Raises:
            ConfigError: Naming the wire, what was measured and the ways on.
        """
        wire = str(given.get("wire", "fp32"))
        bits = FORMATS[wire].bits if wire in FORMATS else 32.0
        if bits >= LOSSY_BELOW_BITS or "adam_moments" in given:
            return
        raise ConfigError(
            f"BMUF with {given.get('optimizer')} on --wire {wire} has no recipe that held "
            "Sync-Adam's WER: BMUF-Adam's recipe sends the parameters and both of Adam's "
            "moment buffers through the wire (3x SGD-BMUF's bytes) and on --wire sign lost "
            "6.1 WER points to Sync-Adam on FSDD's folds (a user's CTC model: 19). The best "
            f"measured, {ADAM_SLOW_LINK} (the moments kept on each worker, only the model "
            "crosses: 254x fewer bytes than SSGD fp32 at tau 8), trailed by 2.1 there, 0.9 on "
            "the espeak set and 0.7 on speechocean762 "
            "(docs/usage.md, Adam on a slow link). Ways on: give those to run it; --wire "
            "int8 or fp32 (BMUF-Adam's recipe, 3/tau of the model's bytes a step); SGD with "
            "--wire sign (the SGD slow-link recipe); or give --adam-moments (corrected: send "
            "the moments on this wire anyway; local: keep them and send only the "
            "parameters) to run another choice")

    def __post_init__(self) -> None:
        if self.sync_period is not None and self.sync_period < 1:
            raise ConfigError(f"{self.flag('sync_period')} must be > 0, got {self.sync_period}")
        if self.block_momentum is not None and not 0.0 <= self.block_momentum < 1.0:
            raise ConfigError(f"{self.flag('block_momentum')} must be in [0, 1) (omit it for "
                              f"1 - 1/N), got {self.block_momentum}")
        if self.block_lr <= 0:
            raise ConfigError(f"{self.flag('block_lr')} must be > 0, got {self.block_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"{self.flag('warmup_steps')} must be >= 0, got "
                              f"{self.warmup_steps}")
        if self.residual_keep is not None and not 0.0 <= self.residual_keep <= 1.0:
            raise ConfigError(f"{self.flag('residual_keep')} must be in [0, 1], got "
                              f"{self.residual_keep}")
        if self.fragments < 1:
            raise ConfigError(f"{self.flag('fragments')} must be >= 1, got {self.fragments}")
        # Without --sync-period the default is at most DEFAULT_SYNC_PERIOD; the block length
        # of the run's worker count is checked again where it is known (BMUF.__init__).
        self.check_fragments(DEFAULT_SYNC_PERIOD if self.sync_period is None
                             else self.sync_period)
        self.check_wire()  # and --adam-moments, --bmuf-warmup-moments, --bmuf-worker-lr

    def check_fragments(self, tau: int) -> None:
        """Refuse more fragments than the block (``tau``) has steps."""
        if self.fragments > tau:
            raise ConfigError(f"{self.flag('fragments')} {self.fragments} is more than "
                              f"{self.flag('sync_period')} {tau}: the fragments "
                              "sync at different steps of a block; lower it or lengthen the "
                              "period")

    def long_block_warning(self, num_workers: int) -> str | None:
        """What to say when a coarse wire runs a block longer than fp32's on many workers.

        On speechocean762 at 16 workers (8 chunks a worker, docs/results.md) the workers
        drift apart over a long block, and a wire below 8 bits a value cannot carry the
        drift back: ``--wire sign`` at tau 40 ended at 93.6 % WER (3 seeds) and at tau 20 at
        91.8 % (seed 0), ``int4`` at tau 32 at 79.2 %, where SSGD had 68.9 and sign at tau
        8 72.4. None where the block is at most fp32's default for ``num_workers``, the
        workers are at most 4 (there sign held at tau 8) or the wire is int8 or finer.
        """
        tau = self.tau(num_workers)
        fp32 = default_sync_period(self.worker_lr, num_workers)
        coarse = FORMATS[self.wire].bits < LOSSY_BELOW_BITS if self.wire in FORMATS else False
        if not coarse or num_workers <= 4 or tau <= fp32:
            return None
        return (f"bmuf --wire {self.wire} at {self.flag('sync_period')} {tau} on {num_workers} "
                f"workers, longer than fp32's block here ({fp32}): on speechocean762 at 16 "
                "workers the workers drifted apart over such blocks and the model stayed far "
                "behind SSGD (--wire sign at tau 20: 92 % WER, at 40: 94 %, against 69 %; "
                f"int4 at 32: 79 %). Leave {self.flag('sync_period')} out (fp32's block) or use "
                "fewer workers")

    def many_nodes_warning(self, num_workers: int) -> str | None:
        """What to say when a sparse wire averages more than 4 super-learners.

        On speechocean762 (8 epochs, docs/results.md, *Sixteen learners as four nodes of
        four, half the rounding kept*) ``--wire signtopk`` trailed SSGD by 1.65 ± 0.29 WER
        points with 16 learners each its own node (5 seeds), by 0.35 ± 0.29 with the same
        16 learners as 4 nodes of 4 (SSGD inside a node, the code only between nodes, half
        of each worker's rounding taken back: default_keep; 11 seeds, SSGD trained beside;
        0.93 ± 0.12 taking all of it back; 0.20 ± 0.14 with ``--sync-period 4``, seeds
        0-8, which on the espeak set was 0.84 ± 0.50 worse than tau 8 over 3 seeds, so
        not said here) and by 0.37 ± 0.20 with 4 learners (6 seeds): fewer nodes averaged
        cost less, so learners that share a fast link belong in one node. The 4 nodes of 4
        on the digit sets (*Sixteen learners as four nodes of four on the digit sets*):
        +0.43 ± 0.49 on FSDD's folds (15 runs), −0.60 ± 0.81 on espeak (5 seeds).
        None up to 4 super-learners or on a dense wire.
        """
        if self.wire not in SPARSE_WIRES or num_workers <= SPARSE_CLOSEST_UP_TO:
            return None
        return (f"bmuf --wire {self.wire} averages {num_workers} nodes: on speechocean762 "
                "signtopk trailed SSGD by 1.6 WER points with 16 learners each its own node, "
                "by about 0.4 with 4 nodes, of one learner or of 4 (docs/results.md). "
                "Learners that share a fast link belong in one node: --ranks-per-node (or "
                "hosts with several learners each), so that only the nodes' means cross the "
                "slow link")

    def warmup_rate(self, num_workers: int) -> str:
        """The warm-up's rate in use: ``warmup_lr``, or its default for ``num_workers``."""
        return self.warmup_lr if self.warmup_lr is not None else default_warmup_lr(num_workers)

    def tau(self, num_workers: int) -> int:
        """The block length in use: ``sync_period``, or its default for ``num_workers``."""
        if self.sync_period is not None:
            return self.sync_period
        return default_sync_period(self.worker_lr, num_workers)

    def share(self, tau: int) -> float | None:
        """A sparse wire's share in use: ``topk_fraction``, or its default for the block."""
        if self.topk_fraction is not None:
            return self.topk_fraction
        return default_share(self.wire, tau)

    def keep(self, residual: str) -> float:
        """The share taken back into the model: ``residual_keep``, or its default.

        Raises:
            ConfigError: If ``residual_keep`` is given where the rounding is error feedback.
        """
        if self.residual_keep is None:
            return default_keep(self.wire, residual)
        if residual != "model":
            raise ConfigError(f"{self.flag('residual_keep')} is read with "
                              f"{self.flag('residual')} model only; this run's rounding is "
                              f"{residual} (drop it or give {self.flag('residual')} model)")
        return self.residual_keep

    def residual_mode(self, num_workers: int) -> str:
        """Where the rounding goes: ``residual``, or its default for the wire and workers."""
        if self.residual is not None:
            return self.residual
        return default_residual(self.wire, num_workers)
