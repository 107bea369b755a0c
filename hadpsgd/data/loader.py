"""A dataset of fixed-length chunks read with coalesced block reads, and its DataLoader."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from hadpsgd.data.reader import FeatureFile, FeatureFileError
from hadpsgd.data.sampler import ChunkBatchSampler, chunk_starts, tail_chunks

Batch = tuple[torch.Tensor, torch.Tensor]


IGNORE = -100
"""The label of a position that does not count (padding, or a frame another chunk holds);
``torch.nn.functional.cross_entropy`` skips it by default."""


class ChunkDataset(Dataset[Batch]):
    """The ``chunk_len``-frame chunks of a feature file, covering every frame once.

    First the non-overlapping chunks of every utterance (:func:`chunk_starts`), then one chunk
    per utterance tail (:func:`tail_chunks`): the last ``chunk_len`` frames of a longer
    utterance with only the uncovered ones labelled, or a whole shorter utterance padded. The
    labels of positions that do not count are :data:`IGNORE`, so every frame of the file is
    labelled in exactly one chunk (``cover_tails=False``: the whole chunks only).

    Batches are fetched with :meth:`__getitems__` (which ``DataLoader`` calls with a whole
    batch of indices when it is given a ``batch_sampler``): the requested chunks are sorted by
    position and runs of chunks that are adjacent in the file are read with one contiguous
    :meth:`FeatureFile.read` each, which matters when a large batch covers much of a file
    (evaluation in file order, small files).

    Args:
        path: The feature file.
        chunk_len: Frames per chunk (the unroll length).
        expected_feat_dim: If given, the feature dimension the model needs.
        cover_tails: Add the tail chunks (default); False drops every utterance's tail.
        verify: Check every label even if the file's validation stamp vouches for them.

    Raises:
        FeatureFileError: If the file is malformed or has another feature dimension.
        ValueError: If ``chunk_len < 1``.
    """

    def __init__(
        self, path: str | os.PathLike[str], chunk_len: int = 21,
        expected_feat_dim: int | None = None, cover_tails: bool = True, verify: bool = False,
    ) -> None:
        if chunk_len < 1:
            raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
        self.file = FeatureFile(path, expected_feat_dim=expected_feat_dim, verify=verify)
        self.chunk_len = int(chunk_len)
        whole = chunk_starts(self.file.offsets, self.chunk_len)
        self.num_whole = len(whole)
        """The first ``num_whole`` chunks are whole; the tail chunks follow."""
        tails = (tail_chunks(self.file.offsets, self.chunk_len) if cover_tails
                 else (np.zeros(0, np.int64),) * 3)
        self.starts = np.concatenate([whole, tails[0]])
        self.keep_from = tails[1]
        """Per tail chunk: the first position whose label counts."""
        self.valid = tails[2]
        """Per tail chunk: the real frames read from its start (the rest is padding)."""

    @property
    def feat_dim(self) -> int:
        """Feature dimension of the file."""
        return self.file.feat_dim

    @property
    def num_classes(self) -> int:
        """Number of classes of the file."""
        return self.file.num_classes

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Batch:
        """One chunk: ``(feats [chunk_len, D], labels [chunk_len])``."""
        feats, labels = self._batch([index])
        return feats[0], labels[0]

    def __getitems__(self, indices: list[int]) -> Batch | WorkerFailure:
        """A batch of chunks in the order given.

        Args:
            indices: Chunk indices in ``[0, len(self))``; duplicates allowed.

        Returns:
            ``(feats, labels)``: float32 ``[b, chunk_len, D]`` and int64 ``[b, chunk_len]``;
            ``b`` may be 0. In a loader worker, a bad frame's error comes back as a
            :class:`WorkerFailure` instead, which :func:`make_loader`'s loader raises.

        Raises:
            FeatureFileError: A frame read holds NaN or Inf (in the calling process).
        """
        try:
            return self._batch(indices)
        except FeatureFileError as err:
            if get_worker_info() is None:
                raise
            return WorkerFailure(err)

    def _batch(self, indices: list[int]) -> Batch:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self.starts)):
            raise IndexError(f"chunk index out of range [0, {len(self.starts)}) for "
                             f"{self.file.path}")
        n, length, dim = len(idx), self.chunk_len, self.file.feat_dim
        feats = np.empty((n, length, dim), dtype=np.float32)
        labels = np.empty((n, length), dtype=np.int64)
        tail = idx >= self.num_whole
        for pos in np.flatnonzero(tail):  # one per utterance: read on their own
            j = int(idx[pos]) - self.num_whole
            start, keep, valid = int(self.starts[idx[pos]]), int(self.keep_from[j]), \
                int(self.valid[j])
            block_f, block_l = self.file.read(start, start + valid)
            feats[pos, :valid] = block_f
            feats[pos, valid:] = 0.0
            labels[pos, :valid] = block_l
            labels[pos, :keep] = IGNORE
            labels[pos, valid:] = IGNORE
        whole = np.flatnonzero(~tail)
        n = len(whole)
        order = whole[np.argsort(self.starts[idx[whole]], kind="stable")]
        starts = self.starts[idx[order]]
        # A run ends where the next chunk does not begin exactly where this one ends
        # (a gap, or a duplicate index whose start repeats).
        breaks = np.flatnonzero(np.diff(starts) != length) + 1
        for run in np.split(np.arange(n), breaks) if n else ():
            first = int(starts[run[0]])
            block_f, block_l = self.file.read(first, first + len(run) * length)
            # Scatter the run back to the positions the caller asked for.
            feats[order[run]] = block_f.reshape(len(run), length, dim)
            labels[order[run]] = block_l.reshape(len(run), length)
        return torch.from_numpy(feats), torch.from_numpy(labels)


# Workers are started fresh ("spawn"), never forked. The training process has initialised MPI
# before it builds its loader, and a forked child inherits MPI's pinned registered memory,
# progress threads and open network endpoints: Open MPI warns and, over InfiniBand/UCX, the
# child can corrupt the parent's transfers. A spawned worker is a new interpreter that imports
# only the data layer (mpi4py is imported lazily by the comm layer, so it never calls
# MPI_Init). Persistent workers pay the start-up once per run.
WORKER_START = "spawn"


@dataclass(frozen=True)
class WorkerFailure:
    """A loader worker's :class:`FeatureFileError`, handed to the training process as a batch.

    torch re-raises a worker's exception as its type built from a message that holds the
    worker's traceback, so a bad frame (a user's error: exit 2, one line naming the file and
    the utterance) would print as a crash. Handed over as data, the error arrives as raised.
    """

    error: FeatureFileError


class _Loader(DataLoader[Batch]):
    """A DataLoader that raises a worker's :class:`WorkerFailure` as the error it carries."""

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        return _raising(super().__iter__())


def _raising(batches: Iterator[Batch | WorkerFailure]) -> Iterator[Batch]:
    for batch in batches:
        if isinstance(batch, WorkerFailure):
            raise batch.error
        yield batch


def _pass_through(batch: Batch) -> Batch:
    # __getitems__ already returns collated tensors; the default collate would try to stack
    # the tuple's two tensors. Module level so that spawned workers can pickle it.
    return batch


def make_loader(
    dataset: ChunkDataset, sampler: ChunkBatchSampler, num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader[Batch]:
    """A DataLoader that yields ``(feats, labels)`` batches as ``sampler`` dictates.

    Workers (``num_workers > 0``) are spawned, not forked (safe after MPI init), persistent
    across epochs, and each opens its own HDF5 handle on first read (see
    :class:`FeatureFile`). Call ``sampler.set_epoch`` before
    iterating each epoch. A frame with NaN or Inf raises :class:`FeatureFileError` (naming
    the file and the utterance) from the iteration, read here or in a worker alike.

    Args:
        dataset: The chunk dataset.
        sampler: This rank's batch sampler.
        num_workers: Background loading processes (0 loads in the calling process).
        pin_memory: Hand out batches in page-locked memory (for a CUDA learner): their copy
            to the GPU can then be asynchronous (``non_blocking=True``) and overlap the
            previous step's kernels instead of stalling the host on a pageable copy.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if sampler.num_chunks != len(dataset):
        raise ValueError(f"sampler was built for {sampler.num_chunks} chunks but the dataset "
                         f"{dataset.file.path} has {len(dataset)}")
    return _Loader(
        dataset, batch_sampler=sampler, collate_fn=_pass_through, num_workers=num_workers,
        persistent_workers=num_workers > 0, pin_memory=pin_memory,
        multiprocessing_context=WORKER_START if num_workers > 0 else None,
    )
