"""The training loop: epochs of synchronised steps, evaluation, metrics and checkpoints."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from hadpsgd.algorithms import Algorithm
from hadpsgd.comm import Topology
from hadpsgd.data import ChunkBatchSampler, ChunkDataset, make_loader
from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint
from hadpsgd.train.evaluate import EvalResult, evaluate
from hadpsgd.train.metrics import MetricsWriter
from hadpsgd.train.schedule import LRSchedule, set_lr


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
    """

    def __init__(self, algo: Algorithm, topo: Topology, train_set: ChunkDataset,
                 heldout_set: ChunkDataset, schedule: LRSchedule, opts: LoopOptions,
                 out_dir: Path, metrics: MetricsWriter, config: dict[str, Any]) -> None:
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
        self.sampler = ChunkBatchSampler(len(train_set), opts.batch_size, topo.rank, topo.size,
                                         seed=opts.seed, shuffle=True, drop_last=True)
        self.loader = make_loader(train_set, self.sampler, num_workers=opts.num_workers)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Checkpoint content: model, algorithm (with optimizer), position, config."""
        with self.algo.evaluation_parameters() as model:
            # The parameters to evaluate / deploy (BMUF's global model); the algorithm's own
            # state holds whatever else it needs to resume exactly.
            evaluated = {k: v.clone() for k, v in model.state_dict().items()}
        return {
            "model": self.algo.model.state_dict(),
            "eval_model": evaluated,
            "algo": self.algo.state_dict(),
            "progress": asdict(self.pos),
            "history": [asdict(r) for r in self.history],
            "config": self.config,
            "world_size": self.topo.size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint written by :meth:`state_dict`."""
        self.algo.model.load_state_dict(state["model"])
        self.algo.load_state_dict(state["algo"])
        self.pos = Position(**state["progress"])
        self.history = [EvalResult(**r) for r in state.get("history", [])]

    def checkpoint(self) -> Path:
        """Sync the replicas and write a checkpoint (rank 0 writes; all ranks wait)."""
        self.algo.sync()
        path = checkpoint_path(self.ckpt_dir, self.pos.global_step)
        if self.topo.rank == 0:
            save_checkpoint(self.state_dict(), path)
        self.topo.barrier()
        self.last_checkpoint = path
        self._checkpointed_step = self.pos.global_step
        return path

    # ------------------------------------------------------------------ loop
    def _done(self) -> bool:
        return bool(self.opts.max_steps) and self.pos.global_step >= self.opts.max_steps

    def run(self) -> list[EvalResult]:
        """Train to the end (all epochs or ``max_steps``); returns the held-out history."""
        while self.pos.epoch < self.opts.epochs and not self._done():
            self._epoch()
            if self.pos.step_in_epoch >= len(self.sampler):
                self._evaluate()
                self.pos.epoch += 1
                self.pos.step_in_epoch = 0
                self.checkpoint()
        # Stopped inside an epoch by max_steps (or resumed a finished run): still leave a
        # held-out figure and a checkpoint of the final state.
        if self._checkpointed_step != self.pos.global_step:
            self._evaluate()
            self.checkpoint()
        return self.history

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
        for feats, labels in self.loader:
            logits = model(feats.to(self.topo.device))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   labels.to(self.topo.device).reshape(-1))
            loss.backward()
            self.algo.step()
            self.algo.zero_grad()
            self.pos.step_in_epoch += 1
            self.pos.global_step += 1
            window += 1
            if bar is not None:
                bar.update(1)
            if self.pos.global_step % self.opts.log_every == 0:
                mean_loss = self.topo.allreduce_(loss.detach().double().cpu().reshape(1))
                elapsed = time.perf_counter() - tic
                fps = window * frames_per_step / max(elapsed, 1e-9)
                self.metrics.write("train", self.pos.global_step, epoch=epoch, lr=lr,
                                   loss=float(mean_loss), frames_per_s=round(fps, 1),
                                   **self.algo.metrics())
                if bar is not None:
                    bar.set_postfix(loss=f"{float(mean_loss):.3f}", fps=f"{fps:.0f}")
                tic, window = time.perf_counter(), 0
            if self.opts.checkpoint_every and \
                    self.pos.global_step % self.opts.checkpoint_every == 0:
                self.checkpoint()
            if self._done():
                break
        if bar is not None:
            bar.close()

    def _evaluate(self) -> EvalResult:
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



def seed_everything(seed: int) -> None:
    """Seed torch so that rank 0's initial model (broadcast to all) is reproducible."""
    torch.manual_seed(seed)
