"""An epoch goes on in another plan or world after exactly the chunks its state had trained.

Without processes: the shards (SSGD, BMUF, ADPSGD on one super-learner) and ADPSGD's pool,
each written at one world size, global batch and slot size and loaded by either plan at
another (``EpochPlan.load_state_dict``, which ``--allow-resume-change np`` and a failure's
survivors use): the chunks the new plan hands out and the ones the state had trained never
meet, and together they are the epoch but for less than one new global batch.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hadpsgd.data import ChunkBatchSampler, PooledBatchSampler
from hadpsgd.data.sampler import as_ranges, range_positions
from hadpsgd.train.loop import Position
from hadpsgd.train.plan import EpochPlan, trained_chunks
from hadpsgd.train.pooled import PooledPlan

SEED = 5


def _plan(chunks: int, batch: int, world: int, group: int | None) -> EpochPlan:
    """The plan of rank 0: sharded (``group`` None) or pooled over super-learners of ``group``."""
    if group is None:
        return EpochPlan(ChunkBatchSampler(chunks, batch, 0, world, seed=SEED), None,
                         lambda *_: False)
    sampler = PooledBatchSampler(chunks, batch, 0, world, seed=SEED, take=lambda: -1,
                                 group_size=group)
    topo = SimpleNamespace(num_nodes=world // group, local_size=group, local_rank=0)
    return PooledPlan(topo, sampler, None, None, lambda *_: False, None, None, dict)


def _state(plan: EpochPlan, pos: Position) -> dict[str, Any]:
    """A checkpoint's common state as far as the plans read it."""
    sampler = plan.sampler
    world = sampler.world_size
    nodes = world // getattr(sampler, "group_size", world)
    return {**plan.state_dict(), "world_size": world,
            "progress": {"epoch": 0, "step_in_epoch": pos.step_in_epoch,
                         "global_step": pos.global_step},
            "config": {"train": {"batch_size": sampler.batch_size},
                       "world": {"size": world, "num_nodes": nodes}}}


def _chunks(plan: EpochPlan, first: int, last: int | None) -> list[int]:
    """The chunks ``plan`` hands out from its step (shards) or ticket (pool) ``first``."""
    sampler = plan.sampler
    sampler.set_epoch(0, start_step=0)
    if isinstance(plan, PooledPlan):
        out = []
        for member in range(sampler.group_size):  # one super-learner takes every ticket
            sampler.group_rank = member
            sampler.order = plan.order
            sampler.take = itertools.count(first).__next__
            sampler.held = None
            sampler.open(sampler.slots if last is None else last)
            out += [c for batch in sampler for c in batch]
        return out
    end = len(sampler) if last is None else last
    ranks = []
    for rank in range(sampler.world_size):
        sampler.rank = rank
        ranks += [c for i, batch in enumerate(sampler) if first <= i < end for c in batch]
    sampler.rank = 0
    return ranks


layouts = st.tuples(st.integers(1, 3), st.integers(1, 4),
                    st.one_of(st.none(), st.integers(1, 3)))


@settings(max_examples=150, deadline=None)
@given(st.integers(12, 90), layouts, layouts, st.data())
def test_either_plan_goes_on_after_exactly_the_chunks_trained(chunks, before, after, data):
    (batch, nodes, group), (batch2, nodes2, group2) = before, after
    world, world2 = nodes * (group or 1), nodes2 * (group2 or 1)
    if chunks < batch * world or chunks < batch2 * world2:
        return
    old = _plan(chunks, batch, world, group)
    perm = old.sampler.permutation()
    # The epoch may have changed world once already: some positions trained before it.
    earlier = data.draw(st.lists(st.integers(0, chunks - 1), unique=True,
                                 max_size=chunks - batch * world))
    old.sampler.set_trained(as_ranges(earlier))
    pos = Position()
    if isinstance(old, PooledPlan):
        slots = old.pooled.slots
        if data.draw(st.booleans()):  # a failure reordered the tickets
            old.order = data.draw(st.permutations(list(range(slots))))
        old.pool_next = data.draw(st.integers(0, slots))
        trained = _chunks(old, 0, old.pool_next)
        pos.step_in_epoch = old.pool_next // nodes
    else:
        pos.step_in_epoch = data.draw(st.integers(0, len(old.sampler)))
        trained = _chunks(old, 0, pos.step_in_epoch)
    trained += perm[range_positions(old.sampler.trained)].tolist()
    pos.global_step = 100 + pos.step_in_epoch
    state = _state(old, pos)
    assert sorted(perm[range_positions(trained_chunks(state, chunks))]) == sorted(trained)

    new = _plan(chunks, batch2, world2, group2)
    moved = Position(pos.epoch, pos.step_in_epoch, pos.global_step)
    new.load_state_dict(state, moved)
    assert moved.global_step == pos.global_step  # the steps go on from the state's
    first = new.pool_next if isinstance(new, PooledPlan) else moved.step_in_epoch
    rest = _chunks(new, first, None)
    assert len(rest) == len(set(rest)) and not set(rest) & set(trained)  # nothing twice
    assert chunks - len(trained) - len(rest) < batch2 * world2  # only the dropped tail
    if isinstance(new, PooledPlan):  # the epoch ends where its chunks do
        assert max(0, new.pooled.slots - new.pool_next) * batch2 * group2 == len(rest)
        assert moved.step_in_epoch == new.pool_next // nodes2
    else:
        assert (len(new.sampler) - moved.step_in_epoch) * batch2 * world2 == len(rest)


def test_a_pool_of_the_same_slots_keeps_its_tickets_and_order():
    old = _plan(64, 2, 4, 1)
    old.order = list(reversed(range(old.pooled.slots)))
    old.pool_next = 9
    state = _state(old, Position(0, 2, 12))
    new = _plan(64, 2, 3, 1)  # 3 super-learners of 1: the same slots, fewer at a step
    pos = Position(0, 2, 12)
    new.load_state_dict(state, pos)
    assert (new.pool_next, new.order, pos.step_in_epoch, pos.global_step) == (
        9, old.order, 3, 12)
    assert not new.sampler.trained


def test_the_state_records_a_prefix_as_an_offset_and_anything_else_as_ranges():
    plan = _plan(40, 2, 2, None)
    plan.sampler.set_trained([(0, 8)])
    assert plan.state_dict() == {"chunk_offset": 8}
    plan.sampler.set_trained([(4, 8), (10, 12), (8, 10)])
    assert plan.state_dict() == {"chunk_trained": [[4, 12]]}
    plan.sampler.set_trained([])
    assert plan.state_dict() == {}
    assert np.array_equal(plan.sampler.untrained_positions(0, 3), np.arange(3))
