"""Batches by frames (issue 60 item 6): length buckets, a padded-frame budget, every learner
the same steps, resumed exactly; and ``Distributed.frame_sampler`` through a user's loop.

The properties are the budget's own (count x longest member <= max_frames), the shard's
(disjoint batches across learners, each sample at most once an epoch, at most
``world_size - 1`` batches left out) and the point of buckets (less padding than one bucket),
checked on random lengths, not on the planner's arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import hadpsgd
from hadpsgd.api import FrameSampler, OptionError
from hadpsgd.data.buckets import FrameBatches
from tests.fakes import OneLearner


def _lengths(n: int, seed: int) -> list[int]:
    """Utterance lengths as speech has them: 1.6-20 s at 100 frames a second, mostly short."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.0, 0.5, n), 160, 2000).astype(int).tolist()


def _padding(lengths: list[int], batches: list[list[int]]) -> float:
    """Padded frames over real frames, over all ``batches``."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return padded / sum(lengths[i] for b in batches for i in b)


@pytest.mark.parametrize(("n", "world", "budget", "seed"),
                         [(300, 4, 8000, 0), (97, 3, 5000, 1), (1000, 16, 20000, 2),
                          (50, 1, 2000, 3)])
def test_every_epoch_keeps_the_budget_and_shards_each_sample_at_most_once(n, world, budget,
                                                                          seed):
    lengths = _lengths(n, seed)
    per_rank = [FrameSampler(lengths, budget, r, world, seed=7) for r in range(world)]
    steps = {len(s) for s in per_rank}
    assert len(steps) == 1 and steps.pop() >= 1  # every learner the same steps
    epochs: list[list[list[list[int]]]] = []
    for epoch in range(3):
        seen: list[int] = []
        taken = []
        for s in per_rank:
            s.set_epoch(epoch)
            batches = list(s)
            assert len(batches) == len(s)  # and the same length in every epoch
            for b in batches:
                assert b and len(b) * max(lengths[i] for i in b) <= budget
            seen += [i for b in batches for i in b]
            taken.append(batches)
        assert len(seen) == len(set(seen))  # disjoint across learners, once an epoch
        left_out = set(range(n)) - set(seen)
        # at most world - 1 batches' worth left out, each batch at most budget / 160 samples
        assert len(left_out) <= (world - 1) * (budget // min(lengths))
        epochs.append(taken)
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch


def test_buckets_pad_less_than_one_bucket():
    lengths = _lengths(2000, 4)
    one = FrameBatches(lengths, 20000, 1, seed=0, buckets=1).epoch(0)
    eight = FrameBatches(lengths, 20000, 1, seed=0, buckets=8).epoch(0)
    # One bucket pads these lengths by 94 %, eight by 18 %: a batch's members are alike.
    assert _padding(lengths, eight) - 1 < (_padding(lengths, one) - 1) / 4


def test_a_sample_over_the_budget_and_too_few_batches_are_named_with_the_fix():
    with pytest.raises(ValueError, match=r"sample 2 has 900 frames, more than "
                                         r"max_frames=800; raise max_frames to at least 900"):
        FrameBatches([100, 200, 900, 50], 800, 1, seed=0)
    with pytest.raises(ValueError, match=r"make 1 batches .* fewer than the 2 learners"):
        FrameBatches([100, 100], 1000, 2, seed=0, buckets=1)
    with pytest.raises(ValueError, match=r"sample 1 has 0 frames"):
        FrameBatches([10, 0], 100, 1, seed=0)
    with pytest.raises(ValueError, match=r"max_frames must be an integer >= 1"):
        FrameBatches([10], 0, 1, seed=0)


def test_a_saved_position_resumes_the_same_batches():
    lengths = _lengths(400, 5)
    straight = FrameSampler(lengths, 6000, 1, 3, seed=2)
    straight.set_epoch(1)
    whole = list(straight)
    part = FrameSampler(lengths, 6000, 1, 3, seed=2)
    part.set_epoch(1)
    for _ in zip(range(5), part, strict=False):
        part.stepped()
    state = part.state_dict()
    assert state == {"epoch": 1, "step": 5}
    resumed = FrameSampler(lengths, 6000, 1, 3, seed=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(resumed) == whole[5:]
    assert resumed.position == len(resumed) + 5


# ------------------------------------------------------------ through Distributed
LENGTHS = [3, 5, 8, 4, 7, 6, 2, 9, 5, 3, 8, 6] * 3
DATA = torch.Generator().manual_seed(1)
X = torch.randn(len(LENGTHS), 10, 4, generator=DATA)


def _loss(model: nn.Module, idx: list[int]) -> torch.Tensor:
    """A padded batch's loss: each sample's first ``LENGTHS[i]`` frames."""
    longest = max(LENGTHS[i] for i in idx)
    mask = torch.tensor([[t < LENGTHS[i] for t in range(longest)] for i in idx])
    out = model(X[idx, :longest])
    return (out.pow(2).sum(-1) * mask).sum() / mask.sum()


def _run(steps: int, state: dict | None = None) -> tuple[hadpsgd.Distributed, FrameSampler]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    dist = hadpsgd.Distributed(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               topology=OneLearner())
    if state is not None:
        dist.load_state_dict(state)
    sampler = dist.frame_sampler(LENGTHS, 20, seed=3, buckets=3)
    epoch = sampler.epoch
    while dist.steps < steps:
        sampler.set_epoch(epoch)
        for idx in sampler:
            assert len(idx) * max(LENGTHS[i] for i in idx) <= 20
            dist.zero_grad()
            loss = _loss(dist.model, idx)
            loss.backward()
            dist.step(loss)
            if dist.steps == steps:
                break
        epoch += 1
    return dist, sampler


def test_distributed_counts_its_steps_and_resumes_them_exactly():
    straight, sampler = _run(20)
    assert len(sampler) < 20  # past an epoch's end
    first, _ = _run(9)
    state = first.state_dict()
    resumed, _ = _run(20, state)
    for a, b in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_shared_pool_refuses_batches_by_frames_naming_the_ways():
    class TwoNodes(OneLearner):
        num_nodes = 2
        equal_nodes = True

    model = nn.Linear(4, 2)
    dist = hadpsgd.Distributed(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               topology=OneLearner())
    # As ADPSGD across two super-learners of one size (which needs a world of processes).
    dist.algorithm.asynchronous = True
    dist.topology = TwoNodes()
    with pytest.raises(OptionError, match=r"shared pool .* sampler\(num_samples, batch_size\)"):
        dist.frame_sampler(LENGTHS, 20)
