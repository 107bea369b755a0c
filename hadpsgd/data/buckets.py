"""Batches by frames: utterances of similar length together, each batch within a frame budget.

What a user of icefall or lhotse expects of variable-length data (lhotse's
``DynamicBucketingSampler``): not a fixed count of samples a batch, which wastes padding on
mixed lengths and runs out of memory on the longest, but batches whose padded size stays
under ``max_frames``, made of samples of similar length.

The plan, identical on every learner:

- the samples are sorted by length and cut into ``buckets`` buckets of equal count (length
  quantiles), so that a batch pads to a length near its members';
- each bucket holds batches of a fixed size, ``max_frames // (its longest sample)``, so that
  no batch's padded size (its count times its longest member) exceeds the budget; the
  number of batches an epoch is therefore the same every epoch (a per-step learning-rate
  schedule needs a fixed epoch length);
- every epoch (``numpy.random.default_rng([seed, epoch])``) shuffles the members of each
  bucket before cutting them into batches, then shuffles the order of all batches;
- step ``s`` gives learner ``r`` batch ``s * world_size + r``: the same number of steps on
  every learner (collectives stay matched); the last ``len(batches) % world_size`` batches
  of the shuffled order are left out of that epoch, as a fixed-size sampler's remainder.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class FrameBatches:
    """The per-epoch batches of a frame budget (see the module docstring).

    Args:
        lengths: Frames of each sample (index ``i`` is ``dataset[i]``), each ``>= 1``.
        max_frames: Padded frames a batch may hold (count x longest member).
        world_size: Learners; each step gives each one batch.
        seed: Shuffling seed, the same on every learner.
        buckets: Length buckets (at most one per sample).

    Raises:
        ValueError: For a bad argument, a sample longer than ``max_frames`` (named with the
            fix), or fewer batches than learners.
    """

    def __init__(self, lengths: Sequence[int], max_frames: int, world_size: int, seed: int,
                 buckets: int = 8) -> None:
        for name, value, low in (("max_frames", max_frames, 1), ("world_size", world_size, 1),
                                 ("seed", seed, 0), ("buckets", buckets, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"frame batches: {name} must be an integer >= {low}, "
                                 f"got {value!r}")
        sizes = np.asarray(lengths, dtype=np.int64)
        if sizes.ndim != 1 or sizes.size == 0:
            raise ValueError("frame batches: lengths must be a non-empty list of frame "
                             "counts, one per sample")
        if int(sizes.min()) < 1:
            at = int(np.argmin(sizes))
            raise ValueError(f"frame batches: sample {at} has {int(sizes[at])} frames; every "
                             "length must be >= 1 (drop empty samples from the dataset)")
        longest = int(np.argmax(sizes))
        if int(sizes[longest]) > max_frames:
            raise ValueError(
                f"frame batches: sample {longest} has {int(sizes[longest])} frames, more than "
                f"max_frames={max_frames}; raise max_frames to at least {int(sizes[longest])} "
                "or cut long samples before batching")
        self.max_frames = max_frames
        self.world_size = world_size
        self.seed = seed
        order = np.argsort(sizes, kind="stable")
        groups = np.array_split(order, min(buckets, sizes.size))
        self.buckets = [g for g in groups if g.size]
        """Sample indices of each bucket, shortest bucket first."""
        self.batch_sizes = [max_frames // int(sizes[g].max()) for g in self.buckets]
        """Samples a batch of each bucket (its last batch an epoch may hold fewer)."""
        pairs = zip(self.buckets, self.batch_sizes, strict=True)
        self.num_batches = sum(-(-g.size // b) for g, b in pairs)
        if self.num_batches < world_size:
            raise ValueError(
                f"frame batches: {sizes.size} samples make {self.num_batches} batches of at "
                f"most {max_frames} frames, fewer than the {world_size} learners that each "
                "take one a step; lower max_frames or use more data")
        self.steps = self.num_batches // world_size
        """Steps an epoch: the same on every learner and in every epoch."""

    def epoch(self, epoch: int) -> list[list[int]]:
        """All the batches of ``epoch`` in training order (``steps * world_size`` of them)."""
        if epoch < 0:
            raise ValueError(f"frame batches: epoch must be >= 0, got {epoch}")
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        for members, size in zip(self.buckets, self.batch_sizes, strict=True):
            shuffled = rng.permutation(members)
            batches += [shuffled[i:i + size].tolist() for i in range(0, shuffled.size, size)]
        order = rng.permutation(len(batches))[:self.steps * self.world_size]
        return [batches[i] for i in order]

    def batch(self, epoch_batches: list[list[int]], step: int, rank: int) -> list[int]:
        """Learner ``rank``'s batch at ``step`` of an epoch's batches."""
        return epoch_batches[step * self.world_size + rank]


__all__ = ["FrameBatches"]
