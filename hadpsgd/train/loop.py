"""The training loop: epochs of synchronised steps, evaluation, metrics and checkpoints.

What a checkpoint holds and its writing are :mod:`hadpsgd.train.saving`'s (:class:`Saving`,
a part of :class:`Trainer`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.nn import functional as F  # noqa: N812

from hadpsgd import env, faults
from hadpsgd.algorithms import Algorithm
from hadpsgd.api import Distributed
from hadpsgd.api.samplers import POOL_SLOTS, ticket_taker
from hadpsgd.comm import World
from hadpsgd.data import ChunkBatchSampler, ChunkDataset, PooledBatchSampler, make_loader
from hadpsgd.data.loader import IGNORE
from hadpsgd.train.control import ControlPoint, DivergedError, DivergenceGuard, NonFiniteError
from hadpsgd.train.evaluate import EvalResult, evaluate, speech_note
from hadpsgd.train.graphs import GraphedForward
from hadpsgd.train.metrics import MetricsWriter
from hadpsgd.train.plan import EpochPlan
from hadpsgd.train.pooled import PooledPlan
from hadpsgd.train.progress import ByteCount, Progress, internode_line, on_terminal
from hadpsgd.train.saving import Position, Saving
from hadpsgd.train.schedule import LRSchedule, set_lr
from hadpsgd.train.snapshot import Positions, Snapshots
from hadpsgd.train.stop import FLAG, StopFlag
from hadpsgd.train.trace import ChunkTrace, Recorder

__all__ = ["DivergedError", "LoopOptions", "NonFiniteError", "Position", "Trainer"]


CUDA_LOADER_WORKERS = 2
"""Loader workers per learner on CUDA when ``--num-workers`` is not given. In the training
process the HDF5 reads of a batch's scattered chunks and their pinning held the GPU idle;
workers read the next batches while the GPU runs the step (docs/gpu.md, the grid)."""


def loader_workers(requested: int | None, cuda: bool) -> int:
    """The loader's worker processes: ``--num-workers`` if given, else the device's default.

    Args:
        requested: ``--num-workers`` (``None`` when not given).
        cuda: Whether the learner trains on a GPU.
    """
    if requested is not None:
        return requested
    return CUDA_LOADER_WORKERS if cuda else 0


@dataclass
class LoopOptions:
    """The loop's knobs (a view of :class:`hadpsgd.config.TrainConfig`)."""

    epochs: int
    batch_size: int
    seed: int
    max_steps: int = 0
    log_every: int = 10
    checkpoint_every: int = 0
    progress: bool = True
    num_workers: int | None = None
    control_every: int = 10
    max_nonfinite: int = 5
    max_loss_ratio: float = 5.0
    keep_checkpoints: int = 3
    keep_best: int = 1
    precision: str = "fp32"
    on_failure: str = "stop"
    cuda_graph: bool = False


class Trainer(Saving):
    """Runs the epochs of one learner; every rank runs the same steps in lock step.

    The loop is a client of the public API (:mod:`hadpsgd.api`), as a user's own loop is:
    its steps go through a :class:`~hadpsgd.api.Distributed`'s ``autocast``, ``step``,
    ``zero_grad``, ``evaluation_model`` and ``finish``; what only a run of the CLI has
    (checkpoints with sharded node parts, the schedule, the plans) it takes from the
    algorithm the object holds.

    Args:
        dist: The model and optimizer under the distributed algorithm.
        topo: The communication topology.
        train_set: Training chunks.
        heldout_set: Held-out chunks, evaluated before a fresh run's first step and after
            every epoch.
        schedule: The learning-rate recipe.
        opts: Loop options.
        out_dir: Run directory (checkpoints under ``out_dir/checkpoints``).
        metrics: Where metrics go (a no-op writer on ranks other than 0).
        config: The resolved configuration, stored in every checkpoint.
        stop: Where stop requests (signals) are recorded; the process-wide flag by default.

    Every ``control_every`` steps (and after every epoch) the ranks agree, with one small
    allreduce at the same global step, on two things: whether any rank was asked to stop (it
    then checkpoints and :attr:`stopped_by` is set) and how many non-finite steps occurred
    (more than ``max_nonfinite`` raises :class:`NonFiniteError` on every rank). The agreed
    training loss and every held-out loss also go through the divergence guard (a loss over
    ``max_loss_ratio`` times the start raises :class:`DivergedError` on every rank).
    """

    def __init__(self, dist: Distributed, topo: World, train_set: ChunkDataset,
                 heldout_set: ChunkDataset, schedule: LRSchedule, opts: LoopOptions,
                 out_dir: Path, metrics: MetricsWriter, config: dict[str, Any],
                 stop: StopFlag = FLAG) -> None:
        self.dist = dist
        self.algo: Algorithm = dist.algorithm
        self.topo = topo
        self.train_set = train_set
        self.heldout_set = heldout_set
        self.schedule = schedule
        self.opts = opts
        self.ckpt_dir = Path(out_dir) / "checkpoints"
        self.metrics = metrics
        self.config = config
        self.pos = Position()
        self.history: list[EvalResult] = []
        self.last_checkpoint: Path | None = None
        self._checkpointed_step = -1
        self._evaluated_step = -1
        self.stopped_by: str | None = None
        """Set when the run ended early on an agreed stop request (after its checkpoint)."""
        self.control = ControlPoint(topo, stop, opts.max_nonfinite)
        classes = train_set.file.num_classes
        self.guard = DivergenceGuard(
            opts.max_loss_ratio, self.algo.divergence_hint,
            reference=math.log(classes) if classes > 1 else None,
            what=f"the loss of a uniform guess over the {classes} classes (ln {classes} = "
                 f"{math.log(max(classes, 2)):.3g}, where training starts)")
        self._plan_bytes = 0
        """Control bytes of the data plans this run has closed (ADPSGD's pool)."""
        # Asynchronous algorithms (ADPSGD) take batches from one shared pool at their own
        # pace; the synchronous ones keep the deterministic shards (exact resume, equivalence).
        self._use_plan(self._plan(
            self.algo.asynchronous and topo.num_nodes > 1 and topo.equal_nodes))
        self._trace: ChunkTrace | None = None
        self.lr = 0.0
        """The learning rate of the current step (set by :meth:`start_epoch`, and each step of
        a gradual start)."""
        # A bad HADPSGD_FAULT is a setup error (exit 2), not a failure at the first step.
        self._inject = faults.active()
        self._step_wait = env.emulated_step_s(topo.rank)
        self.graphed = (GraphedForward(self.algo.model, opts.precision, topo.device)
                        if opts.cuda_graph else None)
        """The model's passes from CUDA graphs (``--cuda-graph``), or ``None``."""
        # The sharded plans (SSGD, BMUF, ADPSGD on one super-learner) go on from the newest
        # control point every survivor holds; learners that take from the pool (ADPSGD) go
        # on from their own replicas as they are (no snapshots needed).
        self.snapshots: Snapshots | None = Snapshots() if (
            opts.on_failure == "continue" and not self.plan.meets) else None
        """With --on-failure continue, the state at the last agreed control points."""
        self.positions = Positions()
        """The data positions back to the one the deployable model has taken in."""
        self._unfinished: dict[str, Any] | None = None
        """The training state before the closing :meth:`_finish`, for the checkpoint after."""

    # ------------------------------------------------------------------ loop
    def _done(self) -> bool:
        return bool(self.opts.max_steps) and self.pos.global_step >= self.opts.max_steps

    def run(self) -> list[EvalResult]:
        """Train to the end (all epochs or ``max_steps``); returns the held-out history.

        Rank 0 ends with the bytes it sent and received across nodes, per trained frame and
        against SSGD in fp32, and every rank's together, payload and control (pairing, data
        pool) apart, and the start's broadcast of the model apart from those
        (:func:`~hadpsgd.train.progress.internode_line`); the totals also go into
        ``metrics.jsonl`` (a ``bytes`` record, ``startup_bytes`` the broadcast's).
        """
        history = self._run()
        control = self.algo.control_bytes() + self._plan_bytes + self.plan.control_bytes()
        mine = ByteCount(*self.algo.internode_bytes(), control)
        counts = self.topo.gather_object(mine, root=0)  # every rank: the world's total
        if self.topo.rank == 0 and self.pos.global_step and counts is not None:
            frames = self.pos.global_step * self.opts.batch_size * self.train_set.chunk_len
            total = ByteCount.total(counts)
            line = internode_line(self.algo, self.pos.global_step, frames, mine, total)
            print(f"[hadpsgd] {line}", flush=True)
            self.metrics.write("bytes", self.pos.global_step, ranks=len(counts),
                               **total.record("world_"), **mine.record("rank0_"),
                               startup_bytes=self.algo.startup_bytes)
        return history

    def _run(self) -> list[EvalResult]:
        # By launch rank: after a failure the survivors renumber, their files do not.
        launch = self.topo.launch_ranks[self.topo.rank] if self.topo.launch_ranks \
            else self.topo.rank
        self._trace = ChunkTrace(launch)
        self._note_position()
        if self.snapshots is not None:
            self.snapshots.take(self)  # where a failure before the first control point goes on
        if self.pos.global_step == 0 and not self.history:
            # A fresh run's starting point, so its summary reads from a real start (not on a
            # resume).
            self._evaluate()
        try:
            while self.pos.epoch < self.opts.epochs and not self._done():
                self._epoch()
                if self.stopped_by:
                    return self.history
                if self.pos.step_in_epoch >= len(self.sampler):
                    if self.pos.epoch + 1 >= self.opts.epochs or self._done():
                        self._finish()  # the last epoch: nothing trained may be left out
                    self._evaluate()
                    self.pos.epoch += 1
                    self.pos.step_in_epoch = 0
                    self.plan.end_epoch()
                    self._note_position()
                    self.checkpoint()
                    if self.agree(None):
                        return self.history
            # Stopped inside an epoch by max_steps (or resumed a finished run): still leave
            # a held-out figure and a checkpoint of the final state.
            if self._checkpointed_step != self.pos.global_step:
                self._finish()
                self._evaluate()
                self.checkpoint()
            return self.history
        finally:
            self._trace.close()

    def _note_position(self) -> None:
        """Note the position now (:class:`Positions`): where the learners step together."""
        if not self.plan.meets:
            self.positions.note(self)

    def close(self) -> None:
        """Release the plan's shared data pool (collective: every rank, after :meth:`run`)."""
        self.plan.close()

    def agree(self, loss: Any, progress: Progress | None = None) -> bool:
        """Agree with every rank (see :mod:`hadpsgd.train.control`); True to stop now.

        With ``progress``, the agreed mean loss goes into the training log.
        """
        verdict = self.control.agree(loss)
        if self.snapshots is not None and verdict.stopped_by is None:
            self.snapshots.take(self)  # every learner passed this agreement
        if verdict.mean_loss is not None:
            self.guard.training(verdict.mean_loss, self.pos.global_step)
        if progress is not None and verdict.mean_loss is not None:
            progress.log(self.pos.global_step, self.pos.epoch, self.lr, verdict.mean_loss)
        if verdict.stopped_by is None:
            return False
        self.stopped_by = verdict.stopped_by
        if self._checkpointed_step != self.pos.global_step:
            self.checkpoint()
        if self.topo.rank == 0:
            print(f"[hadpsgd] stop requested ({self.stopped_by}): stopped after step "
                  f"{self.pos.global_step} with checkpoint {self.last_checkpoint}; continue "
                  "with --resume auto", flush=True)
        return True

    def start_epoch(self) -> Progress:
        """Set the epoch's learning rate and data order; the epoch's progress reporter."""
        epoch = self.pos.epoch
        self._climb_to(self.pos.step_in_epoch)
        self.algo.model.train()
        self.recorder.handed.clear()
        return Progress(self.algo, self.metrics,
                        self.opts.batch_size * self.topo.size * self.train_set.chunk_len,
                        len(self.sampler), self.pos.step_in_epoch, f"epoch {epoch}",
                        bar=self.opts.progress and self.topo.rank == 0 and on_terminal(),
                        lines=self.topo.rank == 0)

    def _climb_to(self, step_in_epoch: int) -> None:
        """Set the rate of the epoch's step ``step_in_epoch`` (the schedule's gradual start)."""
        self.lr = self.schedule.lr_at(self.pos.epoch, step_in_epoch / max(len(self.sampler), 1))
        set_lr(self.algo.optimizer, self.lr)

    def train_step(self, feats: Any, labels: Any, step: int, trace_step: int) -> float:
        """One forward/backward/algorithm step of this learner; returns its loss."""
        epoch = self.pos.epoch
        # Told to a peer whose collective times out waiting for this rank.
        self.topo.now_doing(f"in training step {step} (epoch {epoch}), outside "
                            "communication")
        poison = faults.hit("step", self.topo.rank, step) if self._inject else None
        if self._step_wait:
            time.sleep(self._step_wait)  # HADPSGD_EMULATE_STEP: an emulated device step
        model = self.algo.model
        # From pinned memory on CUDA (make_loader): the copies queue behind the last step's
        # kernels and the host goes on to the forward without waiting for them.
        feats = feats.to(self.topo.device, non_blocking=True)
        if self.graphed is not None and self.graphed.fits(feats):
            logits = self.graphed(feats)  # one launch for the forward (--cuda-graph)
        else:
            with self.dist.autocast():
                logits = model(feats)
        target = labels.to(self.topo.device, non_blocking=True).reshape(-1)
        # Summed over the counted frames (padding and frames of another chunk are IGNORE)
        # and divided by the batch's positions, not by its counted frames: every frame
        # weighs the same in any batch, so N learners' mean gradient is still exactly the
        # gradient of their concatenated batch (SSGD's big-batch equivalence). The softmax
        # and the sum are fp32 whatever the forward's precision.
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target,
                               ignore_index=IGNORE, reduction="sum") / max(target.numel(), 1)
        if poison == "nan":
            loss = loss * float("nan")
        scale = self.dist.loss_scale  # fp16's dynamic loss scale; 1 otherwise
        if poison == "overflow":
            scale *= 2.0**40  # the tests' overflow: fp16's gradient is Inf at this scale
        (loss * scale if scale != 1.0 else loss).backward()
        # The loss is read with the gradients' finiteness and norm: one device sync a step.
        result = self.dist.step(loss.detach())
        self.dist.zero_grad()
        value = result.loss
        loss_finite = math.isfinite(value)
        # An overflow the loss scale was searching for (fp16) is no non-finite data: it is
        # counted by the scaler (overflow_steps in the log), not towards --max-nonfinite.
        searching = result.overflow and loss_finite
        if not loss_finite or not (result.local_finite or searching):
            self.control.note_nonfinite(step, "gradient" if loss_finite else "loss")
        self._trace.write(trace_step, epoch, self.recorder.handed.popleft(), step)
        self.topo.now_doing(f"after step {step}: loading the next batch")
        return value

    def _use_plan(self, plan: EpochPlan) -> None:
        """Draw batches as ``plan`` hands them out (its sampler under the loader)."""
        self.plan = plan
        self.sampler = plan.sampler
        self.recorder = Recorder(self.sampler)
        cuda = self.topo.device.type == "cuda"
        self.loader = make_loader(self.train_set, self.recorder,
                                  num_workers=loader_workers(self.opts.num_workers, cuda),
                                  pin_memory=cuda)

    def keep_the_pool(self) -> None:
        """Take batches from the shared pool even on one super-learner (collective).

        After a failure that left ADPSGD one super-learner, the interrupted epoch goes on in
        the pool's order, so that its slots are still each trained once.
        """
        if not self.plan.meets:
            self._plan_bytes += self.plan.control_bytes()
            self.plan.close()
            self._use_plan(self._plan(True))

    def _plan(self, pooled: bool) -> EpochPlan:
        """The epochs' plan: deterministic shards, or one shared pool (asynchronous)."""
        opts, topo, n = self.opts, self.topo, len(self.train_set)
        if not pooled:
            return EpochPlan(ChunkBatchSampler(n, opts.batch_size, topo.rank, topo.size,
                                               seed=opts.seed, shuffle=True, drop_last=True),
                             opts, self.agree)
        pool = topo.shared_counter(POOL_SLOTS)
        sampler = PooledBatchSampler(n, opts.batch_size, topo.rank, topo.size, seed=opts.seed,
                                     take=ticket_taker(topo, pool, lambda: sampler),
                                     group_size=topo.local_size, group_rank=topo.local_rank)
        return PooledPlan(topo, sampler, pool, opts, self.agree, self.control, self.metrics,
                          self.algo.metrics)

    def _epoch(self) -> None:
        """Train the rest of the epoch, segment by segment, as the plan hands them out.

        The cadence is this method's alone: a control point every ``--control-every`` (and
        a log line every ``--log-every``) of what the plan counts, the end of the run at
        ``--max-steps``, a checkpoint at every ``--checkpoint-every`` boundary.
        """
        plan, opts, pos = self.plan, self.opts, self.pos
        plan.begin(pos)
        progress = self.start_epoch()
        climbing = pos.epoch == 0 and self.schedule.climbs
        while (batches := plan.segment(pos, self.loader)) is not None:
            trained = 0
            for feats, labels in batches:
                step, trace_key = plan.locate(pos)
                if climbing:
                    self._climb_to(pos.step_in_epoch)
                loss = self.train_step(feats, labels, step, trace_key)
                trained += 1
                count = plan.stepped(pos, loss)
                self._note_position()
                progress.step()
                log = count % opts.log_every == 0
                if ((log or count % opts.control_every == 0)
                        and plan.control(loss, log, progress, pos, self.lr)):
                    progress.close()
                    return  # an agreed stop: agree() wrote its checkpoint
                if plan.segment_over(pos):
                    break
            if plan.meet(pos):
                break  # the meeting agreed to stop (with its checkpoint)
            if not trained and not plan.meets:
                break  # nothing left to hand out (never expected: a guard against a spin)
            if plan.epoch_over(pos) or self._done():
                # The run's or the epoch's end: run() finishes the algorithm, evaluates and
                # writes the checkpoint (one here would come before the evaluation).
                break
            if plan.at_checkpoint(pos):
                self.checkpoint()
        progress.close()

    def _evaluate(self) -> EvalResult:
        self.topo.now_doing(f"evaluating held-out after step {self.pos.global_step}")
        with self.dist.evaluation_model() as model:
            result = evaluate(model, self.heldout_set, self.topo,
                              batch_size=4 * self.opts.batch_size,
                              precision=self.opts.precision)
        self.history.append(result)
        self._evaluated_step = self.pos.global_step
        speech = ({} if result.speech_accuracy is None else
                  {"heldout_speech_acc": result.speech_accuracy,
                   "speech_frames": result.speech_frames})
        self.metrics.write("eval", self.pos.global_step, epoch=self.pos.epoch,
                           heldout_loss=result.loss, heldout_acc=result.accuracy,
                           frames=result.frames, **speech)
        if self.topo.rank == 0:
            where = (f"epoch {self.pos.epoch} step {self.pos.global_step}"
                     if self.pos.global_step else "before training")
            print(f"[hadpsgd] {where}: held-out "
                  f"loss {result.loss:.4f}, frame accuracy {result.accuracy:.4f}"
                  + speech_note(result) + self.algo.evaluation_note(), flush=True)
        self.guard.heldout(result.loss, self.pos.global_step)
        return result
