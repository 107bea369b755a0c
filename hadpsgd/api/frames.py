"""A batch sampler by frames for a user's own ``DataLoader``: length buckets, a frame budget.

:meth:`hadpsgd.Distributed.frame_sampler` returns a :class:`FrameSampler`: batches of
samples of similar length whose padded size (count x longest member) stays within
``max_frames`` (:class:`hadpsgd.data.buckets.FrameBatches` plans them), this learner's one of
each step, the same number of steps on every learner and in every epoch. It keeps the
interface of :class:`hadpsgd.api.ShardSampler` (``set_epoch``, :attr:`position`,
``step_scheduler``, ``state_dict``), so that :meth:`hadpsgd.Distributed.step` counts its
steps and a resume goes on at the saved step exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from hadpsgd.api.samplers import CountedSteps
from hadpsgd.data.buckets import FrameBatches


class FrameSampler(CountedSteps):
    """This learner's batch of every step, by frames (see the module docstring).

    Args:
        lengths: Frames of each sample of the dataset.
        max_frames: Padded frames a batch may hold.
        rank: This learner's rank.
        world_size: Number of learners.
        seed: Shuffling seed, the same on every learner.
        buckets: Length buckets.

    Raises:
        ValueError: As :class:`~hadpsgd.data.buckets.FrameBatches` (a sample longer than
            the budget, fewer batches than learners, a bad argument).
    """

    def __init__(self, lengths: Sequence[int], max_frames: int, rank: int, world_size: int,
                 seed: int, buckets: int = 8) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"frame sampler: rank must be in [0, {world_size}), got {rank}")
        self.plan = FrameBatches(lengths, max_frames, world_size, seed, buckets)
        self.rank = rank
        self.epoch = 0
        self.start_step = 0
        self.trained = 0
        """Steps taken in this epoch since :meth:`set_epoch` (or since the resumed point)."""

    def __len__(self) -> int:
        """Steps an epoch (the same on every learner and in every epoch)."""
        return self.plan.steps

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.plan.epoch(self.epoch)
        for step in range(self.start_step, self.plan.steps):
            yield self.plan.batch(batches, step, self.rank)

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Start ``epoch``'s order; after :meth:`load_state_dict`, at the saved step.

        Args:
            epoch: The epoch (>= 0), mixed into the shuffling seed.
            start_step: Batches of the epoch to skip; by default 0, or the saved step when
                ``epoch`` is the epoch a loaded state stopped in.
        """
        start_step = self._start(epoch, start_step)
        if epoch < 0 or not 0 <= start_step <= len(self):
            raise ValueError(f"frame sampler: epoch {epoch} and start step {start_step} must "
                             f"be >= 0 and within the epoch's {len(self)} steps")
        self.epoch, self.start_step, self.trained = epoch, start_step, 0


__all__ = ["FrameSampler"]
