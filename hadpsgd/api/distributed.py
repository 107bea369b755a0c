"""``hadpsgd.Distributed``: a user's model and optimizer under one of hadpsgd's algorithms.

The model, the optimizer, the loss and the data loader stay the user's; this object is made
once, called once per step (after the user's backward), and its state goes into the user's
own checkpoint. It holds one :class:`~hadpsgd.algorithms.Algorithm` from the registry, built
as ``python -m hadpsgd.run`` builds it, and adds what a loop outside hadpsgd needs: the
options checked in the caller's words, the loss scale and autocast of mixed precision, a
sampler for the user's ``DataLoader``, the evaluation model, and a state that resumes
exactly (each super-learner's own part included).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hadpsgd.algorithms import AlgoOptions, Algorithm, StepResult
from hadpsgd.algorithms.gradsync import DEFAULT_GRAD_BUCKET_MB
from hadpsgd.api.frames import FrameSampler
from hadpsgd.api.options import (
    OptionError,
    algorithm_spec,
    build_options,
    check_device,
    check_layout,
    check_optimizer,
    check_shared,
)
from hadpsgd.api.recipe import optimizer_kind, resolve_recipe
from hadpsgd.api.rundir import RunDirectory, api_config
from hadpsgd.api.samplers import Sampler, make_sampler
from hadpsgd.api.setup import init, install_error_hooks
from hadpsgd.api.state import collect, node_part, option_changes
from hadpsgd.comm import World, before_abort
from hadpsgd.precision import autocast

AnySampler = Sampler | FrameSampler
"""Either sampler :meth:`Distributed.step` counts."""


class Distributed:
    """Trains ``model`` with ``optimizer`` under the algorithm ``algo`` (see docs/api.md).

    Every learner (MPI rank) makes one, with the same arguments. Rank 0's parameters (the frozen
    ones too) and buffers are broadcast, so the replicas start identical whatever each rank
    initialised; the buffers (BatchNorm's statistics) then stay in agreement as the algorithm
    says (``sync_buffers``, docs/api.md, *Buffers*).

    Args:
        model: The local replica, already on ``topology.device``.
        optimizer: Any ``torch.optim`` optimizer over all of ``model``'s trainable parameters.
        algo: A registered algorithm: ``ssgd``, ``bmuf`` or ``adpsgd``
            (:func:`hadpsgd.algorithms.names`).
        topology: From :func:`hadpsgd.init`; None makes one (with ADPSGD's
            ``super_learner_size`` as the node size, where given).
        precision: ``fp32``, ``bf16`` or ``fp16``: the forward under :meth:`autocast`; fp16
            adds a dynamic loss scale (:meth:`scale`), the same on every learner that shares
            a gradient.
        max_grad_norm: Clip the averaged gradient to this L2 norm (0: no clipping; None: the
            algorithm's recipe for the optimizer's kind, else 0: BMUF with SGD clips to 1).
        overlap: Average gradient buckets during backward: True, False or ``auto`` (on GPUs).
        grad_bucket_mb: Gradient bucket size in MiB.
        grad_wire: ``fp32`` or ``bf16``: what a gradient bucket is on the wire.
        options: The algorithm's options already built (``BMUFOptions(sync_period=8)``, or
            a run configuration's), instead of keywords.
        run_dir: Where rank 0 keeps the run's ``config.json`` and ``metrics.jsonl``, as the
            CLI's ``--out-dir`` (:mod:`hadpsgd.api.rundir`): ``python -m hadpsgd.plot
            run_dir`` draws it. None: nothing is written.
        log_every: Steps between ``train`` records in ``run_dir``.
        **option_values: The algorithm's own options by name (``sync_period=8`` for BMUF:
            the fields of its ``Options`` dataclass, :class:`hadpsgd.algorithms.BMUFOptions`,
            :class:`hadpsgd.algorithms.ADPSGDOptions`); every algorithm has
            ``sync_buffers`` (True: keep the model's buffers in agreement). Those left out
            take the algorithm's recipe for the optimizer's kind, as ``python -m hadpsgd.run``
            does (BMUF with SGD: ``worker_lr="global"``, ``adam_moments="local"``, clipping at
            1; with Adam the BMUF-Adam paper's), said once on rank 0's stderr.

    Raises:
        OptionError: For an unknown algorithm or option, or a value of the wrong type or out
            of range, naming the keyword (before any communication, on every rank alike).
            One that escapes the script is said once, by rank 0, and every rank exits 2.
            A model not on the topology's device (``.option == "model"``) or a trainable
            parameter not in the optimizer (``.option == "optimizer"``) is one too.
        hadpsgd.comm.TopologyError: If the layout does not suit the algorithm (BMUF needs
            nodes of equal size).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, algo: str = "ssgd",
                 *, topology: World | None = None, precision: str = "fp32",
                 max_grad_norm: float | None = None, overlap: bool | str = "auto",
                 grad_bucket_mb: float = DEFAULT_GRAD_BUCKET_MB, grad_wire: str = "fp32",
                 options: AlgoOptions | None = None, run_dir: str | Path | None = None,
                 log_every: int = 10, **option_values: Any) -> None:
        if topology is None:
            # init() below would install them, but a refusal comes before it: said once too.
            install_error_hooks()
        entry = algorithm_spec(algo)
        said = None
        if options is None:  # built options are the user's every choice: no recipe
            option_values, max_grad_norm, said = resolve_recipe(entry, optimizer,
                                                                option_values, max_grad_norm)
        opts = build_options(entry, option_values, options)
        max_grad_norm = 0.0 if max_grad_norm is None else max_grad_norm
        check_shared(precision, max_grad_norm, overlap, grad_bucket_mb, grad_wire)
        topo = topology if topology is not None else init(ranks_per_node=opts.ranks_per_node())
        if said and topo.rank == 0:
            print(f"[hadpsgd] {said}", file=sys.stderr, flush=True)
        check_layout(opts, topo)
        check_device(model, topo)
        check_optimizer(model, optimizer)
        self.precision = precision
        self.algorithm: Algorithm = entry.cls(
            model, optimizer, topo, options=opts, max_grad_norm=float(max_grad_norm),
            overlap=overlap, grad_bucket_mb=float(grad_bucket_mb), precision=precision,
            grad_wire=grad_wire)
        """The algorithm itself (the same object the CLI's loop drives), for what is not here."""
        self.topology = topo
        self.run_dir: RunDirectory | None = None if run_dir is None else RunDirectory(
            run_dir, topo, api_config(
                algo, opts, optimizer, optimizer_kind(optimizer), topo,
                {"precision": precision, "max_grad_norm": max_grad_norm, "overlap": overlap,
                 "grad_bucket_mb": grad_bucket_mb, "grad_wire": grad_wire}), log_every)
        """The run directory's writer (``run_dir=``), or None."""
        # A failure that ends the job: a record of it where the run keeps its records, as
        # the CLI's run directory has one for a failure it survives (plot marks both).
        self._forget_failures = before_abort(self._record_failure) \
            if self.run_dir is not None and self.run_dir.enabled else None
        self._failure_recorded = False
        self._sampler: AnySampler | None = None
        self._sampler_state: dict[str, Any] | None = None  # loaded before sampler() was made
        self._closed = False
        # Adam's beta1 as given: a scheduler that cycles it (OneCycleLR's cycle_momentum)
        # would silently replace the recipe's (BMUF-Adam's 0.5), so a change is said once.
        self._beta1 = ([g["betas"][0] for g in optimizer.param_groups if "betas" in g]
                       if self.algo == "bmuf" else [])  # only BMUF's recipe sets a beta1

    # ------------------------------------------------------------------ what it holds
    @property
    def model(self) -> nn.Module:
        """The local replica (the model given; its parameters now live in a flat buffer)."""
        return self.algorithm.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer given."""
        return self.algorithm.optimizer

    @property
    def options(self) -> AlgoOptions:
        """The algorithm's validated options (its ``Options`` dataclass)."""
        return self.algorithm.options

    @property
    def algo(self) -> str:
        """The algorithm's registered name."""
        return self.algorithm.name

    @property
    def steps(self) -> int:
        """Steps this learner has taken (skipped ones included), restored by a resume."""
        return self.algorithm.steps

    @property
    def asynchronous(self) -> bool:
        """Whether learners step at their own pace (ADPSGD across super-learners)."""
        return self.algorithm.asynchronous and self.topology.num_nodes > 1

    # ------------------------------------------------------------------ a step
    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of the forward and the loss: ``precision``'s autocast (none for fp32)."""
        return autocast(self.precision, self.topology.device)

    @property
    def loss_scale(self) -> float:
        """What to multiply the loss by before backward: fp16's agreed scale, else 1."""
        return self.algorithm.loss_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times :attr:`loss_scale`: what to call ``backward()`` on (fp16's scaled)."""
        scale = self.algorithm.loss_scale
        return loss * scale if scale != 1.0 else loss

    def step(self, loss: torch.Tensor | None = None) -> StepResult:
        """After the user's ``backward()``: what the algorithm does at a step.

        The gradient mean (all learners for SSGD, the super-learner for BMUF and ADPSGD),
        fp16's unscaling and the scale's agreed update, clipping, the optimizer step (skipped
        on every learner that shares a non-finite gradient), then BMUF's block sync when a
        block ends or ADPSGD's gossip delta. Every wait has the topology's deadline: a peer
        that never comes is named in a :class:`hadpsgd.comm.CommTimeoutError`.

        Args:
            loss: The step's (unscaled) loss, read in the step's one device synchronisation.

        Returns:
            The step's verdict: loss, finiteness (this learner's and the averaged gradient's),
            norm, whether the update was skipped, and whether that was fp16's overflow.
        """
        result = self.algorithm.step(None if loss is None else loss.detach())
        if self._beta1:
            self._check_beta1()
        if self._sampler is not None:
            self._sampler.stepped()
        if self.run_dir is not None:
            groups = self.optimizer.param_groups
            self.run_dir.stepped(self.steps, result.loss,
                                 float(groups[0]["lr"]) if groups else None, self.metrics)
        if self.topology.size > 1:
            # What this rank answers a peer whose collective times out waiting for it.
            self.topology.now_doing(f"in the training script after step {self.steps} "
                                    "(forward, backward or data), outside hadpsgd")
        return result

    def _check_beta1(self) -> None:
        """Say once (rank 0) that something changed the optimizer's beta1 under BMUF."""
        now = [g["betas"][0] for g in self.optimizer.param_groups if "betas" in g]
        if now == self._beta1:
            return
        if self.topology.rank == 0:
            warnings.warn(f"the optimizer's beta1 changed from {self._beta1[0]} to {now[0]} "
                          f"after step {self.steps}: a scheduler sets it (OneCycleLR cycles "
                          "Adam's beta1 unless cycle_momentum=False), so BMUF-Adam's beta1 "
                          "is not the one given; pass cycle_momentum=False to keep it",
                          RuntimeWarning, stacklevel=3)
        self._beta1 = []  # said: not checked again

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several backward passes, reduced once (DDP's ``no_sync``).

        Backward passes inside the block add to the gradients and start no reduction (with
        ``overlap`` a bucket's mean would otherwise start in the first pass, on its gradient
        alone); the pass after the block, then :meth:`step`, reduces the sum. Local: no
        peer waits on it. Divide each micro-batch's loss by their number for a mean. Without
        ``overlap`` every pass already only adds, and the block changes nothing.
        """
        sync = self.algorithm.gradsync
        sync.accumulating = True
        try:
            yield
        finally:
            sync.accumulating = False

    def zero_grad(self) -> None:
        """Zero the gradients in place (``optimizer.zero_grad()`` works too, at a copy's cost)."""
        self.algorithm.zero_grad()

    # ------------------------------------------------------------------ data and evaluation
    def sampler(self, num_samples: int, batch_size: int, seed: int = 0) -> Sampler:
        """A batch sampler for ``DataLoader(dataset, batch_sampler=...)``, made collectively.

        SSGD, BMUF (and ADPSGD on one super-learner): this learner's shard of each step, the
        same number of steps on every learner. ADPSGD across super-learners: the shared,
        work-conserving pool (:class:`hadpsgd.api.PoolSampler`), whose epochs end after a
        different number of steps on each learner. Call ``set_epoch(epoch)`` before every
        epoch; :meth:`step` counts what it trained, which :meth:`state_dict` saves.

        Args:
            num_samples: ``len(dataset)``.
            batch_size: Samples per learner per step.
            seed: Shuffling seed (the same on every learner).
        """
        return self._install(lambda: make_sampler(self.topology, self._pooled, num_samples,
                                                  batch_size, seed))

    def frame_sampler(self, lengths: Sequence[int], max_frames: int, seed: int = 0,
                      buckets: int = 8) -> FrameSampler:
        """Batches by frames: samples of similar length, each batch within ``max_frames``.

        For variable-length data (what lhotse's bucketing samplers give icefall): the
        samples are cut into ``buckets`` length buckets and batched so that a batch's padded
        size (count x longest member) stays within ``max_frames``; each step every learner
        takes one batch, the same number of steps on every learner and in every epoch
        (:class:`hadpsgd.api.FrameSampler`). :meth:`step` counts them and :meth:`state_dict`
        saves where the epoch is, as for :meth:`sampler`. Learners' batches of a step hold
        different frame counts: a loss summed over frames and divided by ``max_frames``
        weighs every frame alike under the mean of gradients.

        Args:
            lengths: Frames of each sample, ``len(dataset)`` of them.
            max_frames: Padded frames a batch may hold.
            seed: Shuffling seed (the same on every learner).
            buckets: Length buckets.

        Raises:
            OptionError: Under ADPSGD's shared pool (across super-learners of one size),
                which hands out batches of a fixed count of samples.
            ValueError: A sample longer than ``max_frames``, fewer batches than learners.
        """
        if self._pooled:
            raise OptionError(
                "algo", "frame_sampler: ADPSGD across super-learners draws batches of a fixed "
                "count of samples from its shared pool (Distributed.sampler); batches by frames "
                "are for SSGD, BMUF or ADPSGD on one super-learner. Use sampler(num_samples, "
                "batch_size) with samples cut to similar lengths, or another algorithm")
        return self._install(lambda: FrameSampler(lengths, max_frames, self.topology.rank,
                                                  self.topology.size, seed, buckets))

    @property
    def _pooled(self) -> bool:
        """Whether batches come from ADPSGD's shared pool.

        As the CLI's loop: the pool needs super-learners of one size (a slot is a batch for
        each member); ADPSGD over unequal nodes keeps the shards.
        """
        return self.asynchronous and self.topology.equal_nodes

    def _install(self, make: Callable[[], AnySampler]) -> Any:
        """Replace the sampler :meth:`step` counts with ``make()``'s, at a loaded state."""
        if self._sampler is not None:
            self._sampler.close()
        self._sampler = make()
        if self._sampler_state is not None:
            self._sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
        return self._sampler

    @contextlib.contextmanager
    def evaluation_model(self) -> Iterator[nn.Module]:
        """The model to evaluate and deploy, inside a ``with`` block (collective).

        SSGD: the replica. BMUF: the global model theta_n swapped in, with the buffers of its
        last block sync (the local model comes back after the block). ADPSGD: a copy holding
        the replicas' average, their buffers' too (the replicas are not changed); with
        ``eval_model="replicas"`` (the default on a ``topk`` or ``sign`` wire) a copy of this
        learner's own replica until :meth:`finish` averages them. Every learner enters it at
        the same point (after an epoch).
        """
        with self._doing("averaging for evaluation"):
            self.algorithm.sync()
        with self.algorithm.evaluation_parameters() as model:
            yield model

    def finish(self) -> None:
        """The end of training, before the last evaluation and checkpoint (collective).

        BMUF averages and filters its last, partial block (no trained step is left out of
        the global model); the others agree as at :meth:`evaluation_model`.
        """
        self.algorithm.finish()

    def metrics(self) -> dict[str, float]:
        """This learner's figures of the CLI's log line.

        ``grad_wire_bytes``; fp16's ``loss_scale`` and ``overflow_steps``; BMUF's and
        ADPSGD's ``wire_bytes`` across nodes; ADPSGD's ``exchanges_per_step``, ``staleness``
        and ``consensus_distance`` (at the last :meth:`evaluation_model`); ``skipped_steps``.
        """
        figures = self.algorithm.metrics()
        figures["steps"] = float(self.algorithm.steps)
        figures["skipped_steps"] = float(self.algorithm.skipped_steps)
        return figures

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, gather: bool = False) -> dict[str, Any]:
        """Everything to resume exactly, for the user's checkpoint (collective).

        The model's parameters, the optimizer's and the algorithm's state, the sampler's
        position and, where super-learners differ (BMUF mid-block, fp16's scale per node),
        each one's own part. By default each rank's dict holds its own node's part, as the
        CLI's checkpoints do: every node leader (``topology.local_rank == 0``) saves its
        dict to a file of its own. With ``gather`` rank 0's dict holds every node's part, so
        rank 0 alone may save it (small models: one file, as with DDP); a node part over
        1 GiB is refused there, since the gather sends every node's in one message.

        Raises:
            ValueError: ``gather`` with node parts too large to gather.
        """
        with self._doing("gathering the state for a checkpoint"):
            sampler = self._sampler.state_dict() if self._sampler is not None else None
            return collect(self.algorithm, self.topology,
                           sampler if sampler is not None else self._sampler_state, gather)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from :meth:`state_dict` (every learner, the same dict or its own rank's).

        Restores the model, so load the user's model state before this, or not at all.

        Args:
            state: What :meth:`state_dict` returned.
            strict: Refuse a state saved with other options of the algorithm
                (``sync_period``, ``block_momentum``, ...): a resume that silently runs
                other ones is not the run it resumes. ``False`` takes the state under this
                object's options (the continuation is then not exact).

        Raises:
            ValueError: For the state of another algorithm or layout, one without this
                learner's node part (a non-zero rank's dict saved with ``gather``), or (with
                ``strict``) one saved with other options, naming each.
        """
        part = node_part(state, self.algo, self.topology)
        changed = option_changes(state, self.options)
        if changed and strict:
            raise ValueError(f"load_state_dict: the state was saved with other {self.algo} "
                             f"options: {'; '.join(changed)}; make Distributed(...) with the "
                             "state's options to continue its run exactly, or pass "
                             "strict=False to take it under these")
        self.model.load_state_dict(state["model"])
        self.algorithm.load_state_dict(state["algorithm"])
        if part is not None:
            self.algorithm.load_node_state(part)
        if state.get("sampler") is not None:
            if self._sampler is not None:
                self._sampler.load_state_dict(state["sampler"])
            else:
                self._sampler_state = state["sampler"]
        if self.run_dir is not None:
            self.run_dir.resumed(self.steps)

    def record_eval(self, loss: float, accuracy: float | None = None,
                    **values: float) -> None:
        """Add an ``eval`` record to ``run_dir``'s ``metrics.jsonl`` (rank 0; no-op without).

        The CLI's names, so that ``python -m hadpsgd.plot`` draws the held-out curves:
        ``heldout_loss`` and ``heldout_acc``, at this learner's step count. Call it on every
        rank or on rank 0 alone (it communicates nothing).

        Args:
            loss: The held-out loss (e.g. from :meth:`evaluation_model`).
            accuracy: The held-out accuracy, if the script has one.
            **values: Any other figures to keep with it (``wer=12.5``).
        """
        if self.run_dir is None:
            return
        extra = {} if accuracy is None else {"heldout_acc": float(accuracy)}
        self.run_dir.write("eval", self.steps, heldout_loss=float(loss), **extra, **values)

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Finish communication in flight and release the sampler's pool (collective)."""
        if self._closed:
            return
        self._closed = True
        self.algorithm.close()
        if self._sampler is not None:
            self._sampler.close()
        if self._forget_failures is not None:
            self._forget_failures()
        if self.run_dir is not None:
            self.run_dir.close()

    def _record_failure(self, message: str, code: int) -> None:
        """``run_dir``'s ``failure`` record of a failure that ends the job (rank 0's view)."""
        if self.run_dir is not None and not self._failure_recorded:
            self._failure_recorded = True  # (the watchdog's thread and the hook may both tell)
            self.run_dir.write("failure", self.steps, error=message, exit_code=code,
                               stopped="the job ended")

    def __enter__(self) -> Distributed:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # On an error the peers may be gone: closing would wait for them until the deadline
        # and bury the error; hadpsgd.init's hook aborts the job instead.
        if exc_type is None:
            self.close()

    def _doing(self, what: str) -> contextlib.AbstractContextManager:
        """``Topology.doing(what)`` (what a stuck peer is told), or nothing on one learner."""
        if self.topology.size > 1:
            return self.topology.doing(what)
        return contextlib.nullcontext()


__all__ = ["Distributed"]
