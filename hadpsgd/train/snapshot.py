"""The state every survivor of a failure holds: a snapshot at each agreed control point.

With ``--on-failure continue`` the survivors of a failure go on from a state they all hold.
A control point is one blocking agreement of every learner (SSGD, BMUF), so after it each
learner keeps, in host memory, what continuing needs, the same as a checkpoint a resume at
another world size adopts (``hadpsgd.assembly.resume.adopt``): the deployable model (BMUF's
global model), the optimizer's state, the position and the held-out history. A failure
inside a control point's agreement may leave some survivors one control point ahead of
others, so the last two are kept and the survivors take the newest one they all have.

A snapshot costs one copy of the model and the optimizer state to host memory per control
point (``--control-every`` steps); only a run with ``--on-failure continue`` takes them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Any

import torch


def copy_state(obj: Any, host: bool = True) -> Any:
    """A deep copy of ``obj`` with every tensor cloned (to host memory unless not ``host``)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if host else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: copy_state(v, host) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_state(v, host) for v in obj)
    return obj


def learner_state(trainer: Any, model: Any = None) -> dict[str, Any]:
    """A host copy of what continuing needs, taken now.

    ``model``'s weights (default: this learner's own replica, as it is now), the optimizer's
    state, the position and the held-out history. Taken without any communication, so it
    also serves after a failure, when the replicas of an asynchronous algorithm (ADPSGD) go
    on as they are.
    """
    algo = trainer.algo
    return {
        **trainer.plan.state_dict(),  # the epoch's chunk offset, as a checkpoint holds it
        "model": copy_state((model or algo.model).state_dict()),
        "algo": {"optimizer": copy_state(algo.optimizer.state_dict())},
        "progress": asdict(trainer.pos),
        "history": [asdict(r) for r in trainer.history],
        "world_size": trainer.topo.size,
        "config": trainer.config,
    }


DEPLOYED_KEY = "deployed"
"""State key: where the deployable model stands in the data, where it lags the position.

The position, the plan's state and the held-out history as they were at the step the
deployable model (BMUF's global model) has taken in every step up to; a run carried over
from that model alone goes on from there (:func:`deployed_view`)."""
POSITIONS_KEY = "positions"
"""State key: the positions the deployable model may still lag to (:class:`Positions`)."""


def deployed_view(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its position, plan state and history those of its deployable model.

    A checkpoint or snapshot whose deployable model lags its position (BMUF mid-block)
    records the position that model was at (:data:`DEPLOYED_KEY`); a run that goes on from
    the deployable model alone (``hadpsgd.assembly.resume.adopt``) goes on from there, so
    that the steps it has not taken in are trained again. Other states are returned as
    they are.
    """
    seen = state.get(DEPLOYED_KEY)
    if not seen:
        return state
    # The plan's keys are the deployed position's alone (an epoch earlier: none carried).
    view = {k: v for k, v in state.items() if k not in seen["plan_keys"]}
    view.update(seen["state"])
    return view


class Positions:
    """The positions of the last steps, back to the one the deployable model has taken in.

    Noted after every step (the sharded plan: one global step is one local step of every
    learner), so that a checkpoint or snapshot can say where its deployable model stands in
    the data (:meth:`deployed`). Plain numbers: saved with the checkpoints for an exact
    resume that goes on mid-block.
    """

    def __init__(self) -> None:
        self._kept: deque[tuple[int, dict[str, Any]]] = deque()

    def note(self, trainer: Any) -> None:
        """Record the trainer's position now; forget those the deployable model is past."""
        step = trainer.pos.global_step
        oldest = step - trainer.algo.steps_not_deployed()
        kept = self._kept
        if step == oldest:
            kept.clear()  # the deployable model is the position's: nothing older is needed
        elif kept and kept[-1][0] == step:
            kept.pop()  # the same step, later: the epoch's end (evaluated, next epoch)
        while len(kept) > 1 and kept[1][0] <= oldest:
            kept.popleft()  # the newest record at or before the oldest step stays
        kept.append((step, {"progress": asdict(trainer.pos), "plan": trainer.plan.state_dict(),
                            "history": len(trainer.history)}))

    def deployed(self, trainer: Any) -> dict[str, Any] | None:
        """The :data:`DEPLOYED_KEY` entry of a state of ``trainer`` now (None: no lag).

        Where the record of that step is gone (a checkpoint written before positions were
        saved), the oldest kept stands in.
        """
        lag = trainer.algo.steps_not_deployed()
        if not lag or not self._kept:
            return None
        oldest = trainer.pos.global_step - lag
        _, rec = next(((s, r) for s, r in reversed(self._kept) if s <= oldest), self._kept[0])
        plan_keys = sorted(set(trainer.plan.state_dict()) | set(rec["plan"]))
        return {"plan_keys": plan_keys,
                "state": {**rec["plan"], "progress": dict(rec["progress"]),
                          "history": [asdict(r) for r in trainer.history[:rec["history"]]]}}

    def state_dict(self) -> list[list[Any]]:
        """The kept positions, as plain lists (a checkpoint's :data:`POSITIONS_KEY`)."""
        return [[step, rec] for step, rec in self._kept]

    def load_state_dict(self, saved: list[list[Any]]) -> None:
        """Restore :meth:`state_dict` (an exact resume)."""
        self._kept = deque((int(step), rec) for step, rec in saved)


class Snapshots:
    """The last two snapshots of a learner, by global step."""

    def __init__(self) -> None:
        self._kept: deque[tuple[int, dict[str, Any]]] = deque(maxlen=2)

    def take(self, trainer: Any) -> None:
        """Keep the trainer's state now (at an agreed control point, on every learner).

        Args:
            trainer: The :class:`hadpsgd.train.loop.Trainer` (not imported: it imports this).
        """
        with trainer.algo.evaluation_parameters() as model:
            # The deployable model: BMUF's global model, the replica elsewhere.
            state = learner_state(trainer, model)
        deployed = trainer.positions.deployed(trainer)
        if deployed is not None:  # BMUF mid-block: its global model is of an earlier step
            state[DEPLOYED_KEY] = deployed
        self._kept.append((trainer.pos.global_step, state))

    @property
    def latest_step(self) -> int:
        """The global step of the newest snapshot (-1 if none)."""
        return self._kept[-1][0] if self._kept else -1

    def at(self, step: int) -> dict[str, Any]:
        """The snapshot of global ``step``.

        Raises:
            KeyError: If this learner has none of that step.
        """
        for kept, state in self._kept:
            if kept == step:
                return state
        raise KeyError(f"no snapshot of step {step} (kept: {[s for s, _ in self._kept]})")
