"""A run's state: what a checkpoint holds, how a run continues from one, and its writing.

:class:`Saving` is that part of :class:`hadpsgd.train.loop.Trainer`: the checkpoint's content
(the model, the algorithm with its optimizer, the data position, the history, the config;
BMUF's global model where it is of an earlier step), the continuation from it, the
collective write (rank 0 the common state, each node leader its super-learner's own part:
:mod:`hadpsgd.train.shards`) and the end of training that keeps what an extended run needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from hadpsgd import faults
from hadpsgd.algorithms import Algorithm
from hadpsgd.api import Distributed
from hadpsgd.api.state import compact
from hadpsgd.comm import World
from hadpsgd.train.best import SCORE_KEY
from hadpsgd.train.checkpoint import checkpoint_path
from hadpsgd.train.control import ControlPoint, DivergenceGuard
from hadpsgd.train.evaluate import EvalResult
from hadpsgd.train.plan import EpochPlan
from hadpsgd.train.shards import PART_KEY, write_sharded
from hadpsgd.train.snapshot import DEPLOYED_KEY, POSITIONS_KEY, Positions, copy_state


class Keeping(Protocol):
    """What of the loop's options the writing reads (:class:`hadpsgd.train.loop.LoopOptions`)."""

    keep_checkpoints: int
    keep_best: int


@dataclass
class Position:
    """Where the next step is: what a checkpoint needs to continue exactly."""

    epoch: int = 0
    """Epoch of the next step (0-based)."""
    step_in_epoch: int = 0
    """Steps of ``epoch`` already taken."""
    global_step: int = 0
    """Steps taken since the start of training."""


class Saving:
    """Checkpoints of a run: their content, the continuation from one, their writing.

    A part of :class:`~hadpsgd.train.loop.Trainer`, which holds the state read here (the
    annotations below).
    """

    dist: Distributed
    algo: Algorithm
    topo: World
    opts: Keeping
    config: dict[str, Any]
    ckpt_dir: Path
    pos: Position
    history: list[EvalResult]
    control: ControlPoint
    guard: DivergenceGuard
    plan: EpochPlan
    positions: Positions
    last_checkpoint: Path | None
    _checkpointed_step: int
    _evaluated_step: int
    _unfinished: dict[str, Any] | None
    _note_position: Callable[[], None]
    """Records the position the deployable model has taken in (the loop's)."""

    @property
    def nonfinite(self) -> list[tuple[int, str]]:
        """This rank's own non-finite events: (global step, "loss" or "gradient")."""
        return self.control.nonfinite

    def state_dict(self, node_parts: int | None = None) -> dict[str, Any]:
        """Checkpoint content: model, algorithm (with optimizer), position, config.

        Args:
            node_parts: How many node parts (:meth:`Algorithm.node_state`, one per node, in
                files of their own: :mod:`hadpsgd.train.shards`) the checkpoint has, if any.
        """
        evaluated = None
        if self.algo.separate_eval_model:
            with self.algo.evaluation_parameters() as model:
                # The parameters to evaluate / deploy (BMUF's global model); the algorithm's
                # own state holds whatever else it needs to resume exactly.
                evaluated = {k: v.clone() for k, v in model.state_dict().items()}
        state = {
            "model": compact(self.algo.model.state_dict()),  # views saved at their size
            "algo": self.algo.state_dict(),
            "progress": asdict(self.pos),
            "history": [asdict(r) for r in self.history],
            "config": self.config,
            "world_size": self.topo.size,
            "nonfinite": list(self.nonfinite),
            "divergence": self.guard.state_dict(),
        }
        state.update(self.plan.state_dict())
        deployed = self.positions.deployed(self)
        if deployed is not None:  # BMUF mid-block: the global model is of an earlier step
            state[DEPLOYED_KEY] = deployed
        if not self.plan.meets:
            state[POSITIONS_KEY] = self.positions.state_dict()
        if self._unfinished is not None:
            # What an extended run goes on from (before the closing sync); the deployable
            # model (eval_model) is the finished one, and of this very position.
            state.update(self._unfinished["state"])
        if self.algo.separate_eval_model:
            state["eval_model"] = evaluated
        if node_parts is not None:
            state[PART_KEY] = node_parts
        return state

    def load_state_dict(self, state: dict[str, Any], node_state: Any = None) -> None:
        """Continue from a checkpoint written by :meth:`state_dict`.

        Args:
            state: The checkpoint's common state (``state.pt``).
            node_state: This node's own part (:func:`hadpsgd.train.shards.load_part`) where
                the checkpoint has parts.
        """
        self.algo.model.load_state_dict(state["model"])
        self.algo.load_state_dict(state["algo"])
        self.pos = Position(**state["progress"])
        self.history = [EvalResult(**r) for r in state.get("history", [])]
        self.control.nonfinite[:] = [tuple(e) for e in state.get("nonfinite", [])]
        self.guard.load_state_dict(state.get("divergence", {}))
        if node_state is not None:
            self.algo.load_node_state(node_state)
        elif state.get("node_states") is not None:  # written before parts were sharded
            self.algo.load_node_state(state["node_states"][self.topo.node])
        self.plan.load_state_dict(state, self.pos)
        self.positions.load_state_dict(state.get(POSITIONS_KEY, []))

    def checkpoint(self) -> Path:
        """Write a checkpoint (collective; every rank waits for the whole).

        Rank 0 writes the common state, each node leader its super-learner's own part where
        they differ (:mod:`hadpsgd.train.shards`).
        """
        self.algo.sync()
        step = self.pos.global_step
        path = checkpoint_path(self.ckpt_dir, step)
        with self.topo.doing(f"writing checkpoint {path.name}"):
            hook = None
            if self.topo.rank == 0 and faults.active():
                def hook(phase: str) -> None:
                    faults.hit(phase, self.topo.rank, step)
            # The configuration too: a resume reads it (and the layout) before MPI starts.
            meta = {"step": step, "epoch": self.pos.epoch, "world_size": self.topo.size,
                    "num_nodes": self.topo.num_nodes, "algo": self.algo.name,
                    "config": self.config}
            if self._evaluated_step == step and self.history:
                # Evaluated at this very step: its score ranks it (--keep-best, best.json).
                meta[SCORE_KEY] = asdict(self.history[-1])
            node_state = (self._unfinished["node"] if self._unfinished is not None
                          else self.algo.node_state())
            write_sharded(self.topo, path, self.state_dict, node_state,
                          keep=self.opts.keep_checkpoints, meta=meta, on_phase=hook,
                          keep_best=self.opts.keep_best)
            if self.topo.rank != 0 and faults.active():
                # A learner that is not the writer dies while rank 0 writes (the tests' hook).
                faults.hit("ckpt-wait", self.topo.rank, step)
            self.topo.barrier()
        self.last_checkpoint = path
        self._checkpointed_step = self.pos.global_step
        self._unfinished = None
        return path

    def _finish(self) -> None:
        """End training (:meth:`Algorithm.finish`), keeping what an extended run needs.

        BMUF's closing sync ends a partial block that a longer run never ends there: the
        state before it (the local models, the filter and the block schedule, the data
        positions) is what the final checkpoint holds for a resume, and the closed global
        model its deployable model, so that a run extended by ``--epochs`` or
        ``--max-steps`` equals the uninterrupted one.
        """
        if self.algo.finish_changes_state():
            # Copies where the tensors are (the closing sync changes them in place), saved
            # as a checkpoint taken now would save them.
            self._unfinished = {
                "state": {"model": copy_state(compact(self.algo.model.state_dict()), False),
                          "algo": copy_state(self.algo.state_dict(), False),
                          POSITIONS_KEY: self.positions.state_dict()},
                "node": copy_state(self.algo.node_state(), False)}
        self.dist.finish()
        self._note_position()


__all__ = ["Position", "Saving"]
