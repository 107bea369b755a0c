"""Where a deployable model that lags the position (BMUF mid-block) stands in the data.

Without processes: :class:`~hadpsgd.train.snapshot.Positions` fed a trainer's position after
every step, with the algorithm's lag as BMUF reports it (the steps of the block in flight),
and :func:`~hadpsgd.train.snapshot.deployed_view`, which a failure's survivors and a resume at
another world size go on from.
"""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

from hadpsgd.train.evaluate import EvalResult
from hadpsgd.train.loop import Position
from hadpsgd.train.plan import CHUNK_OFFSET
from hadpsgd.train.snapshot import DEPLOYED_KEY, Positions, deployed_view


class _Trainer(SimpleNamespace):
    """What :class:`Positions` reads of a trainer: the position, the plan, the lag."""

    def __init__(self, tau: int) -> None:
        self.tau, self.offset = tau, 0
        lag = SimpleNamespace(steps_not_deployed=lambda: self.pos.global_step % self.tau)
        plan = SimpleNamespace(state_dict=self._plan_state)
        super().__init__(pos=Position(), history=[], algo=lag, plan=plan)

    def _plan_state(self) -> dict[str, Any]:
        return {CHUNK_OFFSET: self.offset} if self.offset else {}

    def step(self, positions: Positions) -> None:
        self.pos.step_in_epoch += 1
        self.pos.global_step += 1
        positions.note(self)


def test_the_deployed_position_is_the_last_block_syncs_and_few_are_kept() -> None:
    trainer, positions = _Trainer(tau=4), Positions()
    positions.note(trainer)
    for _ in range(6):
        trainer.step(positions)
    # Blocks end at steps 4 and 8: at step 6 the global model is step 4's.
    deployed = positions.deployed(trainer)
    assert deployed is not None
    assert deployed["state"]["progress"] == {"epoch": 0, "step_in_epoch": 4, "global_step": 4}
    assert [s for s, _ in positions.state_dict()] == [4, 5, 6]  # nothing older than the sync
    trainer.step(positions)
    trainer.step(positions)
    assert positions.deployed(trainer) is None  # at a block sync the model is the position's
    assert [s for s, _ in positions.state_dict()] == [8]


def test_a_block_across_an_epoch_end_goes_back_into_the_epoch_before() -> None:
    trainer, positions = _Trainer(tau=4), Positions()
    for _ in range(3):
        trainer.step(positions)
    evaluated = EvalResult(loss=2.0, accuracy=0.5, frames=10)
    trainer.history.append(evaluated)  # the epoch's end: evaluated, then the next epoch
    trainer.pos.epoch, trainer.pos.step_in_epoch, trainer.offset = 1, 0, 0
    positions.note(trainer)
    for _ in range(6):  # steps 4 (a sync) to 9
        trainer.step(positions)
    trainer.offset = 16  # the plan's state now (chunks carried into this epoch)
    state = {"progress": {"epoch": 1, "step_in_epoch": 6, "global_step": 9},
             CHUNK_OFFSET: 16, "history": [], "world_size": 4}
    state[DEPLOYED_KEY] = positions.deployed(trainer)
    view = deployed_view(state)
    assert view["progress"] == {"epoch": 1, "step_in_epoch": 5, "global_step": 8}
    assert CHUNK_OFFSET not in view  # step 8's plan had none carried
    assert view["history"] == [asdict(evaluated)] and view["world_size"] == 4


def test_a_state_without_a_lag_is_its_own_view() -> None:
    state = {"progress": {"epoch": 0, "step_in_epoch": 3, "global_step": 3}}
    assert deployed_view(state) is state
