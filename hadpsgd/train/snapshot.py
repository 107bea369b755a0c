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


def _host_copy(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor cloned to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
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
        "model": _host_copy((model or algo.model).state_dict()),
        "algo": {"optimizer": _host_copy(algo.optimizer.state_dict())},
        "progress": asdict(trainer.pos),
        "history": [asdict(r) for r in trainer.history],
        "world_size": trainer.topo.size,
        "config": trainer.config,
    }


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
