"""Per-step LR schedules on the samplers' shared position (``step_scheduler``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hadpsgd.api import ShardSampler
from hadpsgd.api.samplers import step_scheduler

# No optimizer steps here: torch warns that the schedule is stepped before the optimizer.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_a_scheduler_is_stepped_up_to_the_position_and_never_back():
    opt = _opt()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    assert step_scheduler(sched, 3.7) == 3  # floor: whole steps only
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)  # multiplicative: 3 steps
    assert step_scheduler(sched, 2.0) == 0 and sched.last_epoch == 3  # behind: left as it is


def test_one_cycle_is_capped_at_its_total_steps():
    opt = _opt()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10)
    step_scheduler(sched, 25.0)  # a position past the end would make OneCycleLR raise
    assert sched.last_epoch == 10


def test_the_shard_samplers_position_counts_its_steps_over_epochs():
    sampler = ShardSampler(100, 5, rank=1, world_size=2, seed=0)  # 10 steps an epoch
    assert len(sampler) == 10
    sampler.set_epoch(0)
    for _ in range(4):
        sampler.stepped()
    assert sampler.position == 4.0
    sampler.set_epoch(1)
    sampler.stepped()
    assert sampler.position == 11.0
    resumed = ShardSampler(100, 5, rank=1, world_size=2, seed=0)
    resumed.load_state_dict({"epoch": 2, "step": 3})
    resumed.set_epoch(2)
    assert resumed.position == 23.0  # a resume goes on where the schedule was
    opt = _opt()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=30)
    assert resumed.step_scheduler(sched) == 23


def test_catching_up_after_a_resume_does_not_warn_of_the_order() -> None:
    """After a resume the scheduler steps up to the saved position before any optimizer step,
    on purpose: torch's "lr_scheduler.step() before optimizer.step()" warning, once per rank
    at every resume on the documented path, is not said (issue 60, item 4)."""
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert step_scheduler(sched, 5.0) == 5
    assert not [w for w in seen if "lr_scheduler" in str(w.message)], seen
    assert sched.last_epoch == 5
