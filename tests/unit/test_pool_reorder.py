"""After a failure, ADPSGD's pool hands out exactly the slots no survivor trained (reorder)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hadpsgd.train.pooled import reorder


def test_the_dead_learners_slots_come_next_and_no_survivors_slot_again():
    # Tickets 0-3 trained before the meeting; since then survivors trained 4, 6 and 8; the
    # dead one had taken 5 and 7; 9 was untaken.
    order, first = reorder(None, 4, {4, 6, 8}, 10)
    assert order == [0, 1, 2, 3, 4, 6, 8, 5, 7, 9] and first == 7


def test_a_smaller_world_with_a_longer_epoch_gets_the_new_slots_at_the_end():
    order, first = reorder(None, 2, {3}, 6)
    assert order[:first] == [0, 1, 3] and sorted(order) == list(range(6))


@given(st.integers(1, 40), st.data())
def test_every_slot_once_and_the_trained_first(slots, data):
    old = data.draw(st.permutations(list(range(slots))))
    start = data.draw(st.integers(0, slots))
    trained = set(data.draw(st.lists(st.sampled_from(old[start:]), unique=True))
                  if start < slots else [])
    new_slots = data.draw(st.integers(max(1, slots - 3), slots + 3))
    order, first = reorder(old, start, trained, new_slots)
    assert sorted(order) == list(range(new_slots))  # a permutation of the new epoch
    done = {s for s in old[:start] if s < new_slots} | {s for s in trained if s < new_slots}
    assert set(order[:first]) == done  # exactly the trained ones come before the first ticket


@given(st.integers(1, 60), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4),
       st.data())
def test_an_epoch_goes_on_at_another_global_batch_right_after_the_chunks_trained(
        chunks, batch, world_before, world_after, data):
    """The shards: the steps of the new world cover exactly the chunks not yet trained."""
    from hadpsgd.data import ChunkBatchSampler

    if chunks < batch * world_before or chunks < batch * world_after:
        return
    before = [ChunkBatchSampler(chunks, batch, r, world_before, seed=3) for r in
              range(world_before)]
    steps = data.draw(st.integers(0, before[0].full_steps))
    trained = [c for s in before for i, b in enumerate(s) if i < steps for c in b]
    after = [ChunkBatchSampler(chunks, batch, r, world_after, seed=3) for r in
             range(world_after)]
    for s in after:
        s.set_offset(steps * batch * world_before)
        s.set_epoch(0, start_step=0)
    rest = [c for s in after for b in s for c in b]
    assert sorted(trained + rest) == sorted(set(trained + rest))  # nothing twice
    assert chunks - len(trained) - len(rest) < batch * world_after  # only the dropped tail
