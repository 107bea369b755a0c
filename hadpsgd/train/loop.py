"""The training loop: epochs of synchronised steps, evaluation, metrics and checkpoints."""

from __future__ import annotations

import collections
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.nn import functional as F  # noqa: N812

from hadpsgd import faults
from hadpsgd.algorithms import Algorithm
from hadpsgd.comm import Topology
from hadpsgd.data import ChunkBatchSampler, ChunkDataset, make_loader
from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint
from hadpsgd.train.evaluate import EvalResult, evaluate
from hadpsgd.train.metrics import MetricsWriter
from hadpsgd.train.schedule import LRSchedule, set_lr
from hadpsgd.train.stop import FLAG, StopFlag

TRACE_ENV = "HADPSGD_TRACE_CHUNKS"
"""If set to a directory, every rank appends the chunk indices of each step it takes to
``<dir>/chunks-rank<r>.jsonl`` (for the exact-resume tests)."""


class NonFiniteError(RuntimeError):
    """Too many steps with a non-finite loss or gradient; raised on every rank alike."""


class _Recorder:
    """A batch sampler that remembers, in order, the batches it handed to the loader."""

    def __init__(self, sampler: ChunkBatchSampler) -> None:
        self.sampler = sampler
        self.handed: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler:
            self.handed.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def num_chunks(self) -> int:
        return self.sampler.num_chunks


@dataclass
class Position:
    """Where the next step is: what a checkpoint needs to continue exactly."""

    epoch: int = 0
    """Epoch of the next step (0-based)."""
    step_in_epoch: int = 0
    """Steps of ``epoch`` already taken."""
    global_step: int = 0
    """Steps taken since the start of training."""


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
    num_workers: int = 0
    control_every: int = 10
    max_nonfinite: int = 5
    keep_checkpoints: int = 3


class Trainer:
    """Runs the epochs of one learner; every rank runs the same steps in lock step.

    Args:
        algo: The distributed algorithm (wraps model and optimizer).
        topo: The communication topology.
        train_set: Training chunks.
        heldout_set: Held-out chunks, evaluated after every epoch.
        schedule: The learning-rate recipe.
        opts: Loop options.
        out_dir: Run directory (checkpoints under ``out_dir/checkpoints``).
        metrics: Where metrics go (a no-op writer on ranks other than 0).
        config: The resolved configuration, stored in every checkpoint.
        stop: Where stop requests (signals) are recorded; the process-wide flag by default.

    Every ``control_every`` steps (and after every epoch) the ranks agree, with one small
    allreduce at the same global step, on two things: whether any rank was asked to stop (it
    then checkpoints and :attr:`stopped_by` is set) and how many non-finite steps occurred
    (more than ``max_nonfinite`` raises :class:`NonFiniteError` on every rank).
    """

    def __init__(self, algo: Algorithm, topo: Topology, train_set: ChunkDataset,
                 heldout_set: ChunkDataset, schedule: LRSchedule, opts: LoopOptions,
                 out_dir: Path, metrics: MetricsWriter, config: dict[str, Any],
                 stop: StopFlag = FLAG) -> None:
        self.algo = algo
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
        self.stop = stop
        self.stopped_by: str | None = None
        """Set when the run ended early on an agreed stop request (after its checkpoint)."""
        self.nonfinite: list[tuple[int, str]] = []
        """This rank's own non-finite events: (global step, "loss" or "gradient")."""
        self.sampler = ChunkBatchSampler(len(train_set), opts.batch_size, topo.rank, topo.size,
                                         seed=opts.seed, shuffle=True, drop_last=True)
        self.recorder = _Recorder(self.sampler)
        self.loader = make_loader(train_set, self.recorder, num_workers=opts.num_workers)
        self._trace: IO[str] | None = None
        if os.environ.get(TRACE_ENV):
            trace_dir = Path(os.environ[TRACE_ENV])
            trace_dir.mkdir(parents=True, exist_ok=True)
            self._trace = open(trace_dir / f"chunks-rank{topo.rank}.jsonl", "a")  # noqa: SIM115

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Checkpoint content: model, algorithm (with optimizer), position, config."""
        evaluated = None
        if self.algo.separate_eval_model:
            with self.algo.evaluation_parameters() as model:
                # The parameters to evaluate / deploy (BMUF's global model); the algorithm's
                # own state holds whatever else it needs to resume exactly.
                evaluated = {k: v.clone() for k, v in model.state_dict().items()}
        state = {
            "model": self.algo.model.state_dict(),
            "algo": self.algo.state_dict(),
            "progress": asdict(self.pos),
            "history": [asdict(r) for r in self.history],
            "config": self.config,
            "world_size": self.topo.size,
            "nonfinite": list(self.nonfinite),
        }
        if self.algo.separate_eval_model:
            state["eval_model"] = evaluated
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint written by :meth:`state_dict`."""
        self.algo.model.load_state_dict(state["model"])
        self.algo.load_state_dict(state["algo"])
        self.pos = Position(**state["progress"])
        self.history = [EvalResult(**r) for r in state.get("history", [])]
        self.nonfinite = [tuple(e) for e in state.get("nonfinite", [])]  # type: ignore[misc]

    def adopt(self, state: dict[str, Any], same_optimizer: bool) -> str:
        """Continue from a checkpoint of another world size or algorithm (not exact).

        Takes its deployable model (BMUF's global model), the optimizer state when the
        optimizer is the same kind, the epoch, and the position inside the epoch scaled to
        the new global batch; the algorithm's own state starts afresh from the weights.

        Returns:
            A one-line summary of what was carried over.
        """
        weights = state.get("eval_model") or state["model"]
        self.algo.model.load_state_dict(weights)
        kept = ["model"]
        if same_optimizer and "optimizer" in state.get("algo", {}):
            try:
                self.algo.optimizer.load_state_dict(state["algo"]["optimizer"])
                kept.append("optimizer state")
            except (ValueError, KeyError):
                pass  # a different parameter layout: start the optimizer afresh
        self.algo.restart_from_model()
        old = Position(**state["progress"])
        old_world = int(state.get("world_size") or self.topo.size)
        old_global = old_world * int(state["config"]["train"]["batch_size"])
        new_global = self.opts.batch_size * self.topo.size
        step_in_epoch = min(old.step_in_epoch * old_global // new_global, len(self.sampler))
        self.pos = Position(old.epoch, step_in_epoch, old.global_step)
        self.history = [EvalResult(**r) for r in state.get("history", [])]
        return (f"carried over {', '.join(kept)}; epoch {old.epoch}, step {step_in_epoch} of "
                f"{len(self.sampler)} in it (was {old.step_in_epoch} at global batch "
                f"{old_global}, now {new_global})")

    def checkpoint(self) -> Path:
        """Sync the replicas and write a checkpoint (rank 0 writes; all ranks wait)."""
        self.algo.sync()
        step = self.pos.global_step
        path = checkpoint_path(self.ckpt_dir, step)
        self.topo.watchdog.activity = f"writing checkpoint {path.name}"
        if self.topo.rank == 0:
            hook = None
            if faults.active():
                def hook(phase: str) -> None:
                    faults.hit(phase, self.topo.rank, step)
            meta = {"step": step, "epoch": self.pos.epoch, "world_size": self.topo.size,
                    "algo": self.algo.name}
            save_checkpoint(self.state_dict(), path, keep=self.opts.keep_checkpoints,
                            meta=meta, on_phase=hook)
        self.topo.barrier()
        self.last_checkpoint = path
        self._checkpointed_step = self.pos.global_step
        return path

    # ------------------------------------------------------------------ loop
    def _done(self) -> bool:
        return bool(self.opts.max_steps) and self.pos.global_step >= self.opts.max_steps

    def run(self) -> list[EvalResult]:
        """Train to the end (all epochs or ``max_steps``); returns the held-out history."""
        try:
            while self.pos.epoch < self.opts.epochs and not self._done():
                self._epoch()
                if self.stopped_by:
                    return self.history
                if self.pos.step_in_epoch >= len(self.sampler):
                    self._evaluate()
                    self.pos.epoch += 1
                    self.pos.step_in_epoch = 0
                    self.checkpoint()
                    if self._control(None, log=False):
                        return self.history
            # Stopped inside an epoch by max_steps (or resumed a finished run): still leave
            # a held-out figure and a checkpoint of the final state.
            if self._checkpointed_step != self.pos.global_step:
                self._evaluate()
                self.checkpoint()
            return self.history
        finally:
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    def _control(self, loss: torch.Tensor | None, log: bool) -> bool:
        """The agreement point (every rank, same global step); returns True to stop now.

        One allreduce of [loss, stop requests, non-finite events] serves the training log,
        the graceful stop and the non-finite limit at once.
        """
        vec = torch.tensor([float(loss) if loss is not None else 0.0,
                            1.0 if self.stop.requested else 0.0, float(len(self.nonfinite))],
                           dtype=torch.float64)
        self.topo.allreduce_(vec, op="sum")
        if log and loss is not None:
            self._log(float(vec[0]) / self.topo.size)
        if int(vec[2]) > self.opts.max_nonfinite:
            self._fail_nonfinite(int(vec[2]))
        if vec[1] > 0:
            # Rare: worth one more collective to say who asked.
            asked = self.topo.allgather_object(self.stop.signame)
            self.stopped_by = ", ".join(f"{sig} on rank {r}" for r, sig in enumerate(asked)
                                        if sig)
            if self._checkpointed_step != self.pos.global_step:
                self.checkpoint()
            if self.topo.rank == 0:
                print(f"[hadpsgd] stop requested ({self.stopped_by}): stopped after step "
                      f"{self.pos.global_step} with checkpoint {self.last_checkpoint}; continue "
                      "with --resume auto", flush=True)
            return True
        return False

    def _fail_nonfinite(self, total: int) -> None:
        events = self.topo.allgather_object(self.nonfinite)
        listed = sorted((step, rank, what) for rank, evs in enumerate(events)
                        for step, what in evs)
        shown = ", ".join(f"step {s} on rank {r} ({w})" for s, r, w in listed[:8])
        more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
        raise NonFiniteError(
            f"{total} non-finite loss/gradient events, more than --max-nonfinite "
            f"{self.opts.max_nonfinite}: {shown}{more}. Those steps were skipped on every "
            "learner that shared them. Lower --lr, set --max-grad-norm, or check the data "
            "around those steps."
        )

    def _epoch(self) -> None:
        epoch = self.pos.epoch
        lr = self.schedule.lr(epoch)
        set_lr(self.algo.optimizer, lr)
        self.sampler.set_epoch(epoch, start_step=self.pos.step_in_epoch)
        steps = len(self.sampler)
        frames_per_step = self.opts.batch_size * self.topo.size * self.train_set.chunk_len
        bar = None
        if self.opts.progress and self.topo.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=self.pos.step_in_epoch, desc=f"epoch {epoch}",
                       unit="step", dynamic_ncols=True, mininterval=1.0)
        model = self.algo.model
        model.train()
        tic, window = time.perf_counter(), 0
        self._bar, self._lr, self._tic, self._window = bar, lr, tic, window
        self._frames_per_step = frames_per_step
        self.recorder.handed.clear()
        inject = faults.active()
        watchdog = self.topo.watchdog
        for feats, labels in self.loader:
            step = self.pos.global_step + 1
            # Told to a peer whose collective times out waiting for this rank.
            watchdog.activity = f"in training step {step} (epoch {epoch}), outside communication"
            poison = faults.hit("step", self.topo.rank, step) if inject else None
            logits = model(feats.to(self.topo.device))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   labels.to(self.topo.device).reshape(-1))
            if poison == "nan":
                loss = loss * float("nan")
            loss.backward()
            self.algo.step()
            self.algo.zero_grad()
            loss = loss.detach()
            loss_finite = math.isfinite(float(loss))
            if not loss_finite or self.algo.local_nonfinite:
                self.nonfinite.append((step, "gradient" if loss_finite else "loss"))
            chunks = self.recorder.handed.popleft()
            if self._trace is not None:
                self._trace.write(json.dumps({"step": step, "epoch": epoch, "chunks": chunks})
                                  + "\n")
                self._trace.flush()
            self.pos.step_in_epoch += 1
            self.pos.global_step += 1
            self._window += 1
            if bar is not None:
                bar.update(1)
            watchdog.activity = f"after step {step}: loading the next batch"
            log = step % self.opts.log_every == 0
            if (log or step % self.opts.control_every == 0) and self._control(loss, log):
                break
            if self.opts.checkpoint_every and step % self.opts.checkpoint_every == 0:
                self.checkpoint()
            if self._done():
                break
        if bar is not None:
            bar.close()

    def _log(self, mean_loss: float) -> None:
        elapsed = time.perf_counter() - self._tic
        fps = self._window * self._frames_per_step / max(elapsed, 1e-9)
        extra = self.algo.metrics()
        if self.algo.skipped_steps:
            extra["skipped_steps"] = float(self.algo.skipped_steps)
        self.metrics.write("train", self.pos.global_step, epoch=self.pos.epoch, lr=self._lr,
                           loss=mean_loss, frames_per_s=round(fps, 1), **extra)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{mean_loss:.3f}", fps=f"{fps:.0f}")
        self._tic, self._window = time.perf_counter(), 0

    def _evaluate(self) -> EvalResult:
        self.topo.watchdog.activity = f"evaluating held-out after step {self.pos.global_step}"
        self.algo.sync()
        with self.algo.evaluation_parameters() as model:
            result = evaluate(model, self.heldout_set, self.topo,
                              batch_size=4 * self.opts.batch_size)
        self.history.append(result)
        self.metrics.write("eval", self.pos.global_step, epoch=self.pos.epoch,
                           heldout_loss=result.loss, heldout_acc=result.accuracy,
                           frames=result.frames)
        if self.topo.rank == 0:
            print(f"[hadpsgd] epoch {self.pos.epoch} step {self.pos.global_step}: held-out "
                  f"loss {result.loss:.4f}, frame accuracy {result.accuracy:.4f}", flush=True)
        return result
