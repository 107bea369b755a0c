"""The work-conserving pool of ADPSGD, without processes: shared tickets, limits, groups."""

import itertools

import pytest

from hadpsgd.data import ChunkBatchSampler, PooledBatchSampler


def _pool(num_chunks=100, batch=4, world=2, group=1):
    counter = itertools.count()  # stands in for the shared atomic counter
    samplers = [PooledBatchSampler(num_chunks, batch, r, world, seed=3,
                                   take=lambda: next(counter), group_size=group,
                                   group_rank=r % group) for r in range(world)]
    return samplers


def test_learners_at_different_paces_share_every_batch_once():
    fast, slow = _pool()
    it_fast, it_slow = iter(fast), iter(slow)
    got_fast, got_slow = [], []
    for _ in range(100):  # the fast learner takes three batches per batch of the slow one
        for _ in range(3):
            b = next(it_fast, None)
            if b is not None:
                got_fast.append(b)
        b = next(it_slow, None)
        if b is not None:
            got_slow.append(b)
    chunks = [c for b in got_fast + got_slow for c in b]
    assert len(chunks) == len(set(chunks)) == fast.slots * 4  # every slot once, none twice
    assert len(got_fast) > 2 * len(got_slow)  # work-conserving: the fast one did more
    # the same chunks as the sharded sampler's epoch (same permutation, same drop)
    sharded = ChunkBatchSampler(100, 4, 0, 2, seed=3)
    perm = sharded.permutation()[: sharded.full_steps * 8]
    assert sorted(chunks) == sorted(perm.tolist())


def test_a_slot_past_the_limit_is_held_for_after_the_meeting():
    a, b = _pool()
    a.open(5)
    b.open(5)
    first = list(a)  # a takes every slot below 5, then takes slot 5 and holds it
    assert len(first) == 5 and a.held == 5 and list(a.handed) == [0, 1, 2, 3, 4]
    assert list(b) == [] and b.held == 6  # b finds the pool past the limit too
    a.open(a.slots)
    assert next(iter(a)) == a.permutation()[5 * 4:6 * 4].tolist()  # the held slot comes first


def test_closing_ends_the_segment_without_losing_a_slot():
    closed = iter([-1])
    s = PooledBatchSampler(100, 4, 0, 2, seed=0, take=lambda: next(closed))
    s.close()
    assert list(s) == [] and s.held is None


def test_a_slot_holds_one_batch_per_member_of_a_super_learner():
    members = [PooledBatchSampler(96, 4, r, 4, seed=1, take=lambda t=r: t, group_size=2,
                                  group_rank=r % 2) for r in range(2)]
    perm = members[0].permutation()
    # slot t of a super-learner of 2: learner-batches 2t (member 0) and 2t + 1 (member 1)
    assert next(iter(members[0])) == perm[0:4].tolist()
    assert next(iter(members[1])) == perm[3 * 4:4 * 4].tolist()
    assert members[0].slots == 96 // (4 * 4) * 2


def test_group_must_divide_the_world():
    with pytest.raises(ValueError, match="divide"):
        PooledBatchSampler(100, 4, 0, 3, seed=0, take=lambda: 0, group_size=2)
