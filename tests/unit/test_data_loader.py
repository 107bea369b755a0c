"""ChunkDataset batches, coalesced block reads and the DataLoader (in-process and workers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hadpsgd.data import ChunkBatchSampler, ChunkDataset, make_loader, write_features
from hadpsgd.data.reader import FeatureFile

D, C, L = 4, 7, 5


def write(path: Path, lengths: list[int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    feats = [rng.standard_normal((n, D)).astype(np.float32) for n in lengths]
    labels = [rng.integers(0, C, size=n) for n in lengths]
    write_features(path, feats, labels, [f"u{i}" for i in range(len(lengths))], C,
                   norm_mean=np.full(D, 0.5, np.float32), norm_std=np.full(D, 2.0, np.float32))
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write(tmp_path / "d.h5", [23, 10, 4, 31, 15, 0, 12])


def reference_chunks(ff: FeatureFile) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every chunk, from the utterances as the spec says: first each utterance's whole
    L-frame chunks, then per utterance its tail: the last L frames with only the uncovered
    ones labelled, or a shorter utterance padded with zeros (labels -100 where not counted)."""
    utts = [ff.read(int(a), int(b)) for a, b in zip(ff.offsets[:-1], ff.offsets[1:],
                                                    strict=True)]
    whole, tails = [], []
    for f, y in utts:
        n = len(y)
        whole += [(f[k:k + L], y[k:k + L]) for k in range(0, n - n % L, L)]
        if n % L == 0:
            continue
        if n >= L:
            lab = y[n - L:].copy()
            lab[:L - n % L] = -100
            tails.append((f[n - L:], lab))
        else:
            pad_f = np.zeros((L, D), np.float32)
            pad_f[:n] = f
            lab = np.full(L, -100, np.int64)
            lab[:n] = y
            tails.append((pad_f, lab))
    return whole + tails


def direct(ds: ChunkDataset, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The expected batch, chunk by chunk from :func:`reference_chunks`."""
    ref = reference_chunks(ds.file)
    return (np.stack([ref[i][0] for i in indices]).reshape(-1, L, D),
            np.stack([ref[i][1] for i in indices]).reshape(-1, L))


class CountingReads:
    def __init__(self, ff: FeatureFile) -> None:
        self.inner, self.calls = ff.read, []

    def __call__(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        self.calls.append((start, stop))
        return self.inner(start, stop)


def test_batches_equal_direct_slices(data: Path) -> None:
    ds = ChunkDataset(data, chunk_len=L)
    # whole chunks of [23, 10, 4, 31, 15, 0, 12], then the tails of 23, 4, 31 and 12
    assert len(ds) == 4 + 2 + 0 + 6 + 3 + 0 + 2 + 4 and ds.num_whole == 17
    rng = np.random.default_rng(1)
    for indices in ([3], [5, 0, 12, 1, 2], rng.integers(0, len(ds), 40).tolist(),
                    [4, 4, 3, 4], list(range(len(ds)))[::-1]):
        x, y = ds.__getitems__(indices)
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape == (len(indices), L, D) and y.shape == (len(indices), L)
        ex, ey = direct(ds, indices)
        np.testing.assert_array_equal(x.numpy(), ex)
        np.testing.assert_array_equal(y.numpy(), ey)
    x, y = ds[7]
    assert x.shape == (L, D) and y.shape == (L,)
    np.testing.assert_array_equal(x.numpy(), direct(ds, [7])[0][0])


def test_empty_batch_and_bad_index(data: Path) -> None:
    ds = ChunkDataset(data, chunk_len=L)
    x, y = ds.__getitems__([])
    assert x.shape == (0, L, D) and y.shape == (0, L)
    with pytest.raises(IndexError, match="d.h5"):
        ds.__getitems__([0, len(ds)])
    with pytest.raises(ValueError, match="chunk_len"):
        ChunkDataset(data, chunk_len=0)


def test_adjacent_chunks_are_read_in_one_block(data: Path) -> None:
    ds = ChunkDataset(data, chunk_len=L)
    counter = CountingReads(ds.file)
    ds.file.read = counter  # type: ignore[method-assign]
    everything = np.random.default_rng(2).permutation(len(ds)).tolist()
    x, _ = ds.__getitems__(everything)
    # Runs of adjacent whole chunks, computed independently: a run breaks after an
    # utterance whose length is not a multiple of L (or at an utterance with no chunk);
    # each tail chunk is one read of its own.
    starts = ds.starts[:ds.num_whole].tolist()
    runs = 1 + sum(b != a + L for a, b in zip(starts, starts[1:], strict=False))
    assert len(counter.calls) == runs + (len(ds) - ds.num_whole) < len(ds)
    assert sorted(counter.calls)[0] == (0, 20)  # utterance u0's four chunks in one read
    np.testing.assert_array_equal(x.numpy(), direct(ds, everything)[0])
    counter.calls.clear()
    ds.__getitems__([0, 2])  # not adjacent: two reads
    assert len(counter.calls) == 2


def test_whole_file_of_exact_multiples_is_one_read(tmp_path: Path) -> None:
    ds = ChunkDataset(write(tmp_path / "m.h5", [10, 5, 20]), chunk_len=L)
    counter = CountingReads(ds.file)
    ds.file.read = counter  # type: ignore[method-assign]
    ds.__getitems__([6, 0, 3, 1, 5, 2, 4])
    assert counter.calls == [(0, 35)]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_matches_sampler(data: Path, workers: int) -> None:
    ds = ChunkDataset(data, chunk_len=L, expected_feat_dim=D)
    ds.file.read(0, 1)  # the parent holds an open handle: workers must open their own
    samplers = [ChunkBatchSampler(len(ds), 2, r, 2, seed=5, drop_last=False) for r in range(2)]
    loader = make_loader(ds, samplers[1], num_workers=workers)
    assert len(loader) == len(samplers[1])
    for epoch in (0, 1):  # persistent workers serve a second epoch too
        samplers[1].set_epoch(epoch)
        batches = list(loader)
        expected = list(samplers[1])
        assert len(batches) == len(expected)
        for (x, y), indices in zip(batches, expected, strict=True):
            if not indices:
                assert x.shape[0] == 0
                continue
            ex, ey = direct(ds, indices)
            np.testing.assert_array_equal(x.numpy(), ex)
            np.testing.assert_array_equal(y.numpy(), ey)


def test_make_loader_checks_sampler_size(data: Path) -> None:
    ds = ChunkDataset(data, chunk_len=L)
    with pytest.raises(ValueError, match="chunks"):
        make_loader(ds, ChunkBatchSampler(len(ds) + 1, 2, 0, 1, seed=0))


def test_every_frame_is_labelled_in_exactly_one_chunk(data: Path) -> None:
    ds = ChunkDataset(data, chunk_len=L)
    _, y = ds.__getitems__(list(range(len(ds))))
    counted = (y != -100).numpy()
    assert counted.sum() == ds.file.num_frames  # 95 frames, none twice, none left out
    # which global frame each counted position is: no frame appears twice
    frames = []
    for i in range(len(ds)):
        start = int(ds.starts[i])
        frames += [start + k for k in np.flatnonzero(counted[i])]
    assert sorted(frames) == list(range(ds.file.num_frames))
    legacy = ChunkDataset(data, chunk_len=L, cover_tails=False)
    assert len(legacy) == 17  # whole chunks only: the tails' 13 frames are dropped


def test_loader_workers_default_reads_ahead_on_cuda_only() -> None:
    """``--num-workers`` left out: workers on CUDA (the GPU must not wait for the read), none
    on CPU; a number given is taken on either device."""
    from hadpsgd.config import DataConfig
    from hadpsgd.train.loop import CUDA_LOADER_WORKERS, loader_workers

    assert DataConfig().num_workers is None
    assert loader_workers(None, cuda=True) == CUDA_LOADER_WORKERS > 0
    assert loader_workers(None, cuda=False) == 0
    assert loader_workers(0, cuda=True) == 0
    assert loader_workers(3, cuda=False) == 3
