"""Chunking utterances and the per-rank batch sampler's contract."""

from __future__ import annotations

import numpy as np
import pytest

from hadpsgd.data import ChunkBatchSampler, chunk_starts


def epoch_batches(sampler: ChunkBatchSampler, epoch: int, **kw: int) -> list[list[int]]:
    sampler.set_epoch(epoch, **kw)
    return list(sampler)


def ranks(num_chunks: int, batch: int, world: int, **kw: object) -> list[ChunkBatchSampler]:
    return [ChunkBatchSampler(num_chunks, batch, r, world, seed=7, **kw)  # type: ignore[arg-type]
            for r in range(world)]


def test_chunk_starts() -> None:
    offsets = np.array([0, 10, 10, 13, 30, 51])
    np.testing.assert_array_equal(chunk_starts(offsets, 4), [0, 4, 13, 17, 21, 25, 30, 34, 38, 42,
                                                             46])
    np.testing.assert_array_equal(chunk_starts(offsets, 21), [30])
    np.testing.assert_array_equal(chunk_starts(offsets, 1), np.arange(51))
    assert chunk_starts(offsets, 100).size == 0
    assert chunk_starts(offsets, 4).dtype == np.int64
    with pytest.raises(ValueError, match="chunk_len"):
        chunk_starts(offsets, 0)


def test_chunk_starts_matches_loop() -> None:
    rng = np.random.default_rng(0)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 60, size=50))])
    for chunk_len in (1, 7, 21):
        expected = [s for u in range(50)
                    for s in range(offsets[u], offsets[u + 1] - chunk_len + 1, chunk_len)]
        np.testing.assert_array_equal(chunk_starts(offsets, chunk_len), expected)


@pytest.mark.parametrize("num_chunks", [1, 13, 40, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shuffle", [True, False])
def test_eval_mode_covers_every_chunk_once(num_chunks: int, world: int, shuffle: bool) -> None:
    samplers = ranks(num_chunks, 4, world, shuffle=shuffle, drop_last=False)
    per_rank = [epoch_batches(s, 3) for s in samplers]
    lengths = {len(b) for b in per_rank}
    assert lengths == {len(samplers[0])}  # every rank takes the same number of steps
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(num_chunks))
    last = [len(batches[-1]) for batches in per_rank]
    assert max(last) - min(last) <= 1  # the remainder is split near-equally
    if not shuffle:  # file order, rank-major within each step
        steps = zip(*per_rank, strict=True)
        assert [i for step in steps for batch in step for i in batch] == list(range(num_chunks))


@pytest.mark.parametrize("world,batch", [(1, 4), (2, 3), (3, 5), (4, 2), (5, 1)])
def test_train_mode_matches_single_rank_big_batch(world: int, batch: int) -> None:
    num_chunks = 103
    per_rank = [epoch_batches(s, 2) for s in ranks(num_chunks, batch, world)]
    single = epoch_batches(ChunkBatchSampler(num_chunks, batch * world, 0, 1, seed=7), 2)
    assert all(len(b) == num_chunks // (batch * world) for b in per_rank)
    assert len(single) == len(per_rank[0])
    for step, big in enumerate(single):
        assert all(len(b[step]) == batch for b in per_rank)
        assert [i for b in per_rank for i in b[step]] == big  # rank-major concatenation
    seen = [i for b in per_rank for batch_ in b for i in batch_]
    assert len(seen) == len(set(seen))  # no chunk twice


def test_epochs_and_seeds() -> None:
    s = ChunkBatchSampler(50, 5, 0, 1, seed=1)
    e0, e1 = epoch_batches(s, 0), epoch_batches(s, 1)
    assert e0 != e1
    assert epoch_batches(s, 0) == e0  # same seed + epoch, same order
    assert epoch_batches(ChunkBatchSampler(50, 5, 0, 1, seed=1), 1) == e1
    assert epoch_batches(ChunkBatchSampler(50, 5, 0, 1, seed=2), 0) != e0
    expected = np.random.default_rng([1, 1]).permutation(50)[:5].tolist()
    assert e1[0] == expected
    assert epoch_batches(ChunkBatchSampler(50, 5, 0, 1, seed=1, shuffle=False), 4)[1] == [
        5, 6, 7, 8, 9]


def test_start_step_skips_then_resets() -> None:
    full = epoch_batches(ChunkBatchSampler(50, 4, 1, 2, seed=3), 5)
    s = ChunkBatchSampler(50, 4, 1, 2, seed=3, start_step=2)
    assert len(s) == len(full) == 6
    s.set_epoch(5)  # the first set_epoch after construction keeps the constructor's skip
    assert list(s) == full[2:]
    assert list(s) == full[2:]  # the same epoch again: same skip
    s.set_epoch(6)
    assert len(list(s)) == 6  # later epochs start at step 0
    assert epoch_batches(s, 5, start_step=4) == full[4:]
    assert epoch_batches(s, 5, start_step=6) == []
    fresh = ChunkBatchSampler(50, 4, 1, 2, seed=3, start_step=3)
    assert list(fresh) == epoch_batches(ChunkBatchSampler(50, 4, 1, 2, seed=3), 0)[3:]


def test_start_step_with_remainder() -> None:
    s = ChunkBatchSampler(10, 3, 0, 2, seed=0, drop_last=False)  # 1 full step + remainder
    full = epoch_batches(s, 0)
    assert len(full) == 2 and len(full[1]) == 2
    assert epoch_batches(s, 0, start_step=1) == full[1:]
    assert epoch_batches(s, 0, start_step=2) == []


def test_empty_batches_keep_ranks_in_step() -> None:
    per_rank = [epoch_batches(s, 0) for s in ranks(2, 4, 5, drop_last=False)]
    # Two chunks over five ranks: one step everywhere, ranks 2..4 get empty lists.
    assert [[len(batch) for batch in b] for b in per_rank] == [[1], [1], [0], [0], [0]]
    assert sorted(b[0][0] for b in per_rank[:2]) == [0, 1]


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        ChunkBatchSampler(10, 0, 0, 1, seed=0)
    with pytest.raises(ValueError, match="rank"):
        ChunkBatchSampler(10, 1, 2, 2, seed=0)
    with pytest.raises(ValueError, match="world_size"):
        ChunkBatchSampler(10, 1, 0, 0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        ChunkBatchSampler(10, 1, 0, 1, seed=-1)
    with pytest.raises(ValueError, match="start_step"):
        ChunkBatchSampler(10, 1, 0, 1, seed=0, start_step=11)
    with pytest.raises(ValueError, match="epoch"):
        ChunkBatchSampler(10, 1, 0, 1, seed=0).set_epoch(-1)
    with pytest.raises(ValueError, match=r"has 10 chunks but the global batch needs 12.*"
                                         r"reduce --batch-size"):
        ChunkBatchSampler(10, 4, 0, 3, seed=0)
    assert len(ChunkBatchSampler(10, 4, 0, 3, seed=0, drop_last=False)) == 1
    assert list(ChunkBatchSampler(0, 4, 0, 3, seed=0, drop_last=False)) == []
