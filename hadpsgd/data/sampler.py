"""Cutting utterances into fixed-length chunks and splitting shuffled chunks across learners."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

Ranges = list[tuple[int, int]]
"""Half-open ranges ``[lo, hi)`` of positions in an epoch's chunk order, sorted and disjoint."""


def as_ranges(positions: Sequence[int] | np.ndarray) -> Ranges:
    """``positions`` (any order, repeats allowed) as the fewest sorted disjoint ranges."""
    pos = np.unique(np.asarray(positions, dtype=np.int64))
    if pos.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1  # where a run of consecutive positions ends
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [pos.size]))
    return [(int(pos[a]), int(pos[b - 1]) + 1) for a, b in zip(starts, ends, strict=True)]


def range_positions(ranges: Sequence[Sequence[int]]) -> np.ndarray:
    """Every position the ranges hold, ascending where the ranges are."""
    parts = [np.arange(int(lo), int(hi), dtype=np.int64) for lo, hi in ranges]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def untrained(ranges: Sequence[Sequence[int]], num_chunks: int) -> np.ndarray:
    """The positions of ``range(num_chunks)`` outside ``ranges``, ascending."""
    keep = np.ones(num_chunks, dtype=bool)
    for lo, hi in ranges:
        keep[max(0, int(lo)):max(0, min(int(hi), num_chunks))] = False
    return np.flatnonzero(keep)


def tail_chunks(offsets: np.ndarray, chunk_len: int) -> tuple[np.ndarray, np.ndarray,
                                                              np.ndarray]:
    """The chunks that cover what :func:`chunk_starts` leaves out: each utterance's tail.

    An utterance of ``L >= chunk_len`` frames with ``r = L % chunk_len > 0`` gets one chunk of
    its last ``chunk_len`` frames, of which only the last ``r`` count (the others belong to
    a regular chunk already): the model sees a full unroll of real context, and every frame
    is counted once. A shorter utterance (``0 < L < chunk_len``) gets one chunk of its ``L``
    frames, padded at the end; the padding does not count.

    Args:
        offsets: ``[U+1]`` utterance boundaries.
        chunk_len: Frames per chunk.

    Returns:
        ``(starts, keep_from, valid)``: the chunks' global start frames, the first position
        whose label counts, and the number of real frames read (the rest is padding).
    """
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    rest = lengths % chunk_len
    long_tail = (lengths >= chunk_len) & (rest > 0)
    short = (lengths > 0) & (lengths < chunk_len)
    utts = np.flatnonzero(long_tail | short)
    is_long = long_tail[utts]
    starts = np.where(is_long, offsets[utts + 1] - chunk_len, offsets[utts])
    keep_from = np.where(is_long, chunk_len - rest[utts], 0)
    valid = np.where(is_long, chunk_len, lengths[utts])
    return starts.astype(np.int64), keep_from.astype(np.int64), valid.astype(np.int64)


def chunk_starts(offsets: np.ndarray, chunk_len: int) -> np.ndarray:
    """Global start frames of the non-overlapping ``chunk_len``-frame chunks of each utterance.

    Utterance u yields ``offsets[u] + k * chunk_len`` for every k with the chunk inside the
    utterance; the tail shorter than ``chunk_len`` is dropped. Starts are in file order.

    Args:
        offsets: ``[U+1]`` utterance boundaries (as in the feature file).
        chunk_len: Frames per chunk (the BLSTM unroll length, 21 in the paper).

    Returns:
        int64 array of start frames.

    Raises:
        ValueError: If ``chunk_len < 1``.
    """
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    offsets = np.asarray(offsets, dtype=np.int64)
    per_utt = np.diff(offsets) // chunk_len
    total = int(per_utt.sum())
    # Vectorised: utterance u's start repeated per_utt[u] times, plus k * chunk_len where k
    # counts 0, 1, ... within each utterance (position minus the utterance's first position).
    first = np.cumsum(per_utt) - per_utt
    k = np.arange(total, dtype=np.int64) - np.repeat(first, per_utt)
    return np.repeat(offsets[:-1], per_utt) + k * chunk_len


class ChunkBatchSampler(Sampler[list[int]]):
    """Per-step batches of chunk indices for one learner, shuffled per epoch.

    Each epoch permutes all chunks with ``np.random.default_rng([seed, epoch])`` (or keeps file
    order when ``shuffle=False``), identically on every rank. With global batch
    ``G = batch_size * world_size``, step s gives rank r the slice
    ``perm[s*G + r*batch_size : s*G + (r+1)*batch_size]``: the ranks' batches at one step are
    disjoint and, concatenated rank-major, equal what one rank with batch ``G`` would get.

    With ``drop_last=True`` there are ``num_chunks // G`` steps and the remainder is unused this
    epoch. With ``drop_last=False`` (evaluation) the remainder is one extra step, split into
    ``world_size`` contiguous parts whose sizes differ by at most one (possibly empty lists),
    so every chunk is visited exactly once over all ranks and every rank takes the same
    number of steps (collectives stay matched).

    Args:
        num_chunks: Number of chunks in the dataset.
        batch_size: Chunks per learner per step.
        rank: This learner's rank.
        world_size: Number of learners.
        seed: Shuffling seed, the same on every rank.
        shuffle: Permute per epoch (training) or keep file order.
        drop_last: Drop the incomplete last global batch.
        start_step: Skip this many batches of the first epoch iterated (mid-epoch resume).

    Raises:
        ValueError: On invalid arguments, or when ``drop_last`` leaves no step at all.
    """

    def __init__(
        self, num_chunks: int, batch_size: int, rank: int, world_size: int, seed: int,
        shuffle: bool = True, drop_last: bool = True, start_step: int = 0,
    ) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_chunks = int(num_chunks)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.global_batch = self.batch_size * self.world_size
        if drop_last and self.num_chunks < self.global_batch:
            raise ValueError(
                f"the data has {self.num_chunks} chunks but the global batch needs "
                f"{self.global_batch} ({self.batch_size} per learner x {self.world_size} "
                f"learners); reduce --batch-size or use more data")
        self.full_steps = self.num_chunks // self.global_batch
        self.remainder = self.num_chunks - self.full_steps * self.global_batch
        self.offset = 0
        """Chunks of this epoch's order trained before its step 0 (see :meth:`set_trained`)."""
        self.trained: Ranges = []
        """Which positions of this epoch's order those are (see :meth:`set_trained`)."""
        # The untrained positions, ascending; None where the trained ones are a prefix (the
        # rest is then offset, offset + 1, ...: no array of the epoch's size to keep).
        self._rest: np.ndarray | None = None
        self.epoch = 0
        self._fresh = True  # no set_epoch() yet: the constructor's start_step still applies
        self.start_step = self._check_start_step(start_step)

    def set_offset(self, offset: int) -> None:
        """Start the epoch's steps after the first ``offset`` chunks of its order.

        :meth:`set_trained` of the one range ``[0, offset)``.
        """
        if not 0 <= offset <= self.num_chunks:
            raise ValueError(f"offset must be in [0, {self.num_chunks}], got {offset}")
        self.set_trained([(0, offset)] if offset else [])

    def set_trained(self, ranges: Sequence[Sequence[int]]) -> None:
        """Start the epoch's steps after the chunks at ``ranges`` of its order: they were trained.

        Where a run goes on at another global batch (after a failure, or a resume at another
        world size or plan) in the middle of an epoch: the steps of the new global batch cover
        exactly the other positions, in the order's own order. The trained positions need not
        be a prefix: ADPSGD's pool hands out slots in any order, and a run may change twice in
        one epoch. Empty again from the next epoch on (the caller resets it).

        Args:
            ranges: ``[lo, hi)`` positions of the epoch's order (clipped to the data set).
        """
        kept = as_ranges(range_positions(
            [(max(0, int(lo)), min(int(hi), self.num_chunks)) for lo, hi in ranges]))
        self.trained = kept
        self.offset = sum(hi - lo for lo, hi in kept)
        prefix = not kept or (len(kept) == 1 and kept[0][0] == 0)
        self._rest = None if prefix else untrained(kept, self.num_chunks)
        rest = self.num_chunks - self.offset
        self.full_steps = rest // self.global_batch
        self.remainder = rest - self.full_steps * self.global_batch

    def untrained_positions(self, lo: int, hi: int) -> np.ndarray:
        """Positions ``lo:hi`` of the epoch's order among those not trained before step 0."""
        if self._rest is None:
            return np.arange(self.offset + lo, self.offset + hi, dtype=np.int64)
        return self._rest[lo:hi]

    def _check_start_step(self, start_step: int) -> int:
        if not 0 <= start_step <= len(self):
            raise ValueError(f"start_step must be in [0, {len(self)}] (steps per epoch), "
                             f"got {start_step}")
        return int(start_step)

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Select the epoch whose permutation the next iteration uses.

        Args:
            epoch: Epoch number (>= 0), mixed into the shuffling seed.
            start_step: Batches of this epoch to skip. ``None`` keeps the constructor's
                ``start_step`` on the first call after construction (so ``ChunkBatchSampler(
                ..., start_step=k)`` followed by ``set_epoch(e)`` resumes epoch e at step k)
                and means 0 on every later call.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)
        if start_step is not None:
            self.start_step = self._check_start_step(start_step)
        elif not self._fresh:
            self.start_step = 0
        self._fresh = False

    def permutation(self) -> np.ndarray:
        """All chunk indices in this epoch's order (the same on every rank)."""
        if self.shuffle:
            return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_chunks)
        return np.arange(self.num_chunks)

    def __len__(self) -> int:
        """Steps per epoch (the same on every rank), counting skipped ``start_step`` ones."""
        extra = 0 if self.drop_last or self.remainder == 0 else 1
        return self.full_steps + extra

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's chunk indices for each step of the epoch, from ``start_step``."""
        # Iterating also ends the "fresh" state: a later set_epoch() without start_step must
        # not re-apply the constructor's skip.
        self._fresh = False
        perm = self.permutation()
        g, b, r = self.global_batch, self.batch_size, self.rank
        for step in range(self.start_step, self.full_steps):
            lo = step * g + r * b
            yield perm[self.untrained_positions(lo, lo + b)].tolist()
        if self.start_step <= self.full_steps and len(self) > self.full_steps:
            # The remainder as world_size contiguous near-equal parts: the first
            # (remainder % world_size) ranks get one chunk more.
            base, extra = divmod(self.remainder, self.world_size)
            lo = self.full_steps * g + r * base + min(r, extra)
            yield perm[self.untrained_positions(lo, lo + base + (r < extra))].tolist()


class PooledBatchSampler(ChunkBatchSampler):
    """Work-conserving batches: every super-learner takes the next one from one shared pool.

    The epoch's permutation is cut into learner-batches of ``batch_size`` chunks (the same
    chunks the sharded sampler uses), grouped into *slots* of ``group_size`` learner-batches,
    one per member of a super-learner. ``take()`` returns the next free slot index, shared by
    all super-learners (an atomic counter; inside a super-learner its leader takes and the
    members receive it), so a fast super-learner takes more slots than a slow one and nobody
    waits; every slot is taken exactly once. A negative ticket means the leader closed.

    Iteration stops at :attr:`limit` (a checkpoint, the epoch's end or ``--max-steps``, where
    the learners meet): a slot taken at or past it is *held* and handed out first after the
    meeting, so no slot is lost or taken twice. :meth:`close` stops taking (a stop request):
    the batches already handed to the loader still come out, then the iteration ends.

    Args:
        num_chunks, batch_size, rank, world_size, seed: As for :class:`ChunkBatchSampler`.
        take: Returns the next free slot index (the same pool on every learner), or a
            negative number once the super-learner's leader has closed.
        group_size: Learners per super-learner (a slot holds one batch for each).
        group_rank: This learner's place in its super-learner.
    """

    def __init__(self, num_chunks: int, batch_size: int, rank: int, world_size: int,
                 seed: int, take: Callable[[], int], group_size: int = 1,
                 group_rank: int = 0) -> None:
        super().__init__(num_chunks, batch_size, rank, world_size, seed, shuffle=True,
                         drop_last=True)
        if world_size % group_size or not 0 <= group_rank < group_size:
            raise ValueError(f"group_size {group_size} must divide world_size {world_size} "
                             f"and group_rank {group_rank} lie in it")
        self.take = take
        self.group_size = group_size
        self.group_rank = group_rank
        self.limit = self.slots
        """Slots at or past this index wait for the next meeting."""
        self.held: int | None = None
        """A slot taken past :attr:`limit`, to be trained after the meeting."""
        self.handed: collections.deque[int] = collections.deque()
        """Slots handed to the loader and not yet trained, oldest first (a loader with
        workers prefetches: the step being trained is the oldest, not the last)."""
        self.closed = False
        """Set by :meth:`close`: the next ticket is a refusal."""
        self.order: list[int] | None = None
        """The slot each ticket of this epoch hands out (None: ticket ``t`` is slot ``t``).
        Set after a failure, so that the slots a dead learner had taken come next and the
        survivors' are not handed out again (``hadpsgd.assembly.elastic``)."""

    @property
    def slots(self) -> int:
        """Slots per epoch (of the chunks not trained before it: :meth:`set_trained`)."""
        return self.full_steps * self.world_size // self.group_size

    def slot_of(self, ticket: int) -> int:
        """The slot a ticket hands out (see :attr:`order`)."""
        order = self.order
        return order[ticket] if order is not None and 0 <= ticket < len(order) else ticket

    def close(self) -> None:
        """Take no more slots this segment (the loader still yields what it was handed)."""
        self.closed = True

    def open(self, limit: int) -> None:
        """Start a segment: hand out slots below ``limit``."""
        self.limit = min(limit, self.slots)
        self.closed = False

    def __iter__(self) -> Iterator[list[int]]:
        """Yield the chunk indices of each slot this learner takes, until the segment ends."""
        self._fresh = False
        perm = self.permutation()
        b = self.batch_size
        while True:
            slot = self.held if self.held is not None else self.take()
            self.held = None
            if slot < 0:
                return
            if slot >= self.limit:
                self.held = slot if slot < self.slots else None
                return
            self.handed.append(slot)
            lo = (self.slot_of(slot) * self.group_size + self.group_rank) * b
            yield perm[self.untrained_positions(lo, lo + b)].tolist()
