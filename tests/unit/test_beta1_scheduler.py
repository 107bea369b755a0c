"""A scheduler that cycles Adam's beta1 under BMUF-Adam is said once (issue 60, item 4):
OneCycleLR's ``cycle_momentum`` replaced the recipe's beta1 0.5 silently (a 0.5 and a 0.9
run came out bit-identical). Two learners as threads, each its own super-learner."""

from __future__ import annotations

import warnings

import pytest
import torch

import hadpsgd
from hadpsgd.comm.threads import ThreadJob, ThreadWorld


def run(cycle_momentum: bool) -> list[str]:
    """Six BMUF-Adam steps under OneCycleLR; the warnings rank 0 raised."""
    def learner(world: ThreadWorld) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.5, 0.999))
        dist = hadpsgd.Distributed(model, opt, "bmuf", topology=world, sync_period=2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10,
                                                    cycle_momentum=cycle_momentum)
        for _ in range(6):
            loss = dist.model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            dist.step(loss)
            dist.zero_grad()
            sched.step()
        dist.close()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ThreadJob(2, 1, timeout=30).run(learner)
    return [str(w.message) for w in seen if "beta1" in str(w.message)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_cycled_beta1_is_said_once_naming_the_fix() -> None:
    said = run(cycle_momentum=True)
    assert len(said) == 1, said
    assert "beta1 changed from 0.5" in said[0] and "cycle_momentum=False" in said[0], said


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_scheduler_that_keeps_beta1_says_nothing() -> None:
    assert run(cycle_momentum=False) == []
