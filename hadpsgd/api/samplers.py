"""Batch samplers for a user's own ``DataLoader``: shards, or ADPSGD's shared pool.

Both hand out lists of sample indices (``DataLoader(dataset, batch_sampler=...)``), shuffled
per epoch from the seed, and both are the samplers ``python -m hadpsgd.run`` trains with,
given what they need to live outside its loop:

- :class:`ShardSampler` (SSGD, BMUF, and ADPSGD on one super-learner) is
  :class:`~hadpsgd.data.ChunkBatchSampler`: every learner its deterministic shard, the same
  number of steps on every learner, the ranks' batches of a step together the batch one
  process with N times the batch size would take (SSGD's big-batch equivalence). It counts
  the steps :meth:`hadpsgd.Distributed.step` takes, so that its state resumes mid-epoch exactly.
- :class:`PoolSampler` (ADPSGD across super-learners) is
  :class:`~hadpsgd.data.PooledBatchSampler` over a shared counter (the CLI's
  :func:`ticket_taker`): each super-learner takes the next batch when it
  is ready, so a slow one takes fewer and nobody waits; every batch of the epoch is taken
  exactly once. Its iteration ends when the pool is empty, after a different number of steps
  on each super-learner. :meth:`PoolSampler.set_epoch` is where the learners meet.

Both give a per-step learning-rate schedule one notion of progress: :attr:`position`, the
steps of ``len(sampler)`` per epoch done so far, the same on every learner (under the pool,
the batches every super-learner took, in one learner's steps), and :meth:`step_scheduler`,
which steps a ``torch.optim.lr_scheduler`` up to it. Stepping a scheduler once per local step
instead gives each ADPSGD learner its own rate (a fast learner is further on), and a
``OneCycleLR(total_steps=epochs * len(loader))`` raises on a fast learner that takes more
than ``len(loader)`` batches in an epoch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from hadpsgd.comm import SharedCounter, World
from hadpsgd.data import ChunkBatchSampler, PooledBatchSampler

SLOT_NEXT, SLOT_STOP, SLOT_NONFINITE, SLOT_LOSS, SLOT_LOGGED = range(5)
POOL_SLOTS = 5
"""Shared counters: next free data slot, stop requests, non-finite events, loss sum (in
micro-nats) and the number of losses in it."""


def ticket_taker(topo: World, pool: SharedCounter,
                 sampler: Callable[[], PooledBatchSampler]) -> Callable[[], int]:
    """``take()`` for the pooled sampler, the same ticket on every member of a super-learner.

    The leader takes a slot (or refuses, -1, once the sampler is closed); the members receive
    its ticket.
    """
    ticket = torch.zeros(1, dtype=torch.int64)  # host tensor: the intra-node MPI path

    def take() -> int:
        if topo.local_rank == 0:
            ticket[0] = -1 if sampler().closed else pool.take(SLOT_NEXT)
        if topo.local_size > 1:
            topo.intra_broadcast_(ticket, root=0)
        return int(ticket[0])

    return take


_NONE = 2**62
"""Larger than any slot: a learner that holds no untrained slot."""


def step_scheduler(scheduler: Any, position: float) -> int:
    """Step ``scheduler`` until it has taken ``floor(position)`` steps; how many it took.

    A scheduler is stepped, never set, so that every ``torch.optim.lr_scheduler`` works
    (chained and multiplicative ones included); one that is ahead is left as it is. Capped at
    a ``OneCycleLR``'s ``total_steps``, which raises past it.
    """
    target = int(position)
    total = getattr(scheduler, "total_steps", None)
    if total is not None:
        target = min(target, int(total))
    taken = 0
    with warnings.catch_warnings():
        # torch warns when a scheduler steps before its optimizer did: after a resume the
        # catch-up to the saved position does so on purpose (once per rank, every resume).
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`",
                                category=UserWarning)
        while scheduler.last_epoch < target:
            scheduler.step()
            taken += 1
    return taken


class CountedSteps:
    """The steps trained since ``set_epoch``: a position, a scheduler's and a state.

    What the samplers of fixed epochs share (:class:`ShardSampler`,
    :class:`hadpsgd.api.FrameSampler`): :meth:`hadpsgd.Distributed.step` counts. The
    sampler sets :attr:`epoch`, :attr:`start_step` and :attr:`trained` at each
    ``set_epoch`` (its own) and has ``len()`` steps an epoch (its own ``__len__``).
    """

    epoch: int
    start_step: int
    trained: int
    _resume: tuple[int, int] | None = None

    def _start(self, epoch: int, start_step: int | None) -> int:
        """The first step of ``epoch``: ``start_step``, else a loaded state's, else 0."""
        if start_step is None:
            start_step = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        self._resume = None
        return start_step

    def stepped(self) -> None:
        """One batch was trained (called by :meth:`hadpsgd.Distributed.step`)."""
        self.trained += 1

    @property
    def position(self) -> float:
        """Steps done since the first epoch's start, ``len(self)`` an epoch.

        Every learner's the same: they step together.
        """
        return float(self.epoch * len(self) + self.start_step + self.trained)

    def step_scheduler(self, scheduler: Any) -> int:
        """Step a per-step LR ``scheduler`` up to :attr:`position` (see the module docstring).

        Returns:
            The steps the scheduler took (1 after every training step here).
        """
        return step_scheduler(scheduler, self.position)

    def state_dict(self) -> dict[str, Any]:
        """Where the next step is: ``{"epoch", "step"}`` (the next epoch's start at its end)."""
        step = self.start_step + self.trained
        if step >= len(self):
            return {"epoch": self.epoch + 1, "step": 0}
        return {"epoch": self.epoch, "step": step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at :meth:`state_dict`'s point: :attr:`epoch` is the epoch to go on with."""
        epoch, step = int(state["epoch"]), int(state["step"])
        self.set_epoch(epoch, start_step=step)  # type: ignore[attr-defined]
        self._resume = (epoch, step)

    def close(self) -> None:
        """Nothing to release."""


class ShardSampler(CountedSteps, ChunkBatchSampler):
    """This learner's shard of every step's global batch (see the module docstring).

    Args:
        num_samples: Samples in the dataset (indices ``0 .. num_samples - 1``).
        batch_size: Samples per learner per step.
        rank: This learner's rank.
        world_size: Number of learners.
        seed: Shuffling seed, the same on every learner.

    Raises:
        ValueError: If the data do not fill one global batch.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int,
                 seed: int) -> None:
        super().__init__(num_samples, batch_size, rank, world_size, seed, shuffle=True,
                         drop_last=True)
        self.trained = 0
        """Steps taken in this epoch since :meth:`set_epoch` (or since the resumed point)."""

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Start ``epoch``'s order; after :meth:`load_state_dict`, at the saved step.

        Args:
            epoch: The epoch (>= 0), mixed into the shuffling seed.
            start_step: Batches of the epoch to skip; by default 0, or the saved step when
                ``epoch`` is the epoch a loaded state stopped in.
        """
        super().set_epoch(epoch, start_step=self._start(epoch, start_step))
        self.trained = 0


class PoolSampler(PooledBatchSampler):
    """Batches from one pool shared by every super-learner (see the module docstring).

    Made collectively (every learner, the same arguments). Call :meth:`set_epoch` before
    each epoch on every learner: it is a meeting (it resets the shared pool, so every learner
    must have finished the previous epoch), and :meth:`close` at the end (also collective).

    Args:
        topo: The learners; a slot holds one batch for each member of a super-learner.
        num_samples, batch_size, seed: As for :class:`ShardSampler`.
    """

    def __init__(self, topo: World, num_samples: int, batch_size: int, seed: int) -> None:
        self.topo = topo
        self.pool: SharedCounter | None = topo.shared_counter(POOL_SLOTS)
        take: Callable[[], int] = ticket_taker(topo, self.pool, lambda: self)
        super().__init__(num_samples, batch_size, topo.rank, topo.size, seed, take=take,
                         group_size=topo.local_size, group_rank=topo.local_rank)
        self.trained = 0
        """Batches this learner trained in this epoch (its own pace: it differs by learner)."""
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Every learner meets and the pool restarts at ``epoch``'s first (or saved) slot.

        Args:
            epoch: The epoch (>= 0), mixed into the shuffling seed.
            start_step: The first slot to hand out; by default 0, or the saved slot when
                ``epoch`` is the epoch a loaded state stopped in.
        """
        if start_step is None:
            start_step = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        self._resume = None
        super().set_epoch(epoch, start_step=0)  # slots are the pool's, not the shard's steps
        self._restart(start_step)

    def _restart(self, first_slot: int) -> None:
        """Collective: the pool's next slot is ``first_slot``; nothing is held or pending."""
        assert self.pool is not None, "the sampler was closed"
        self.held = None
        self.handed.clear()
        self.pool.reset([first_slot] + [0] * (POOL_SLOTS - 1))
        self.open(self.slots)
        self.trained = 0

    def stepped(self) -> None:
        """The oldest slot handed to the loader was trained (by :meth:`Distributed.step`)."""
        if self.handed:
            self.handed.popleft()
        self.trained += 1

    @property
    def position(self) -> float:
        """The pool's progress since the first epoch's start, in one learner's steps.

        Every super-learner's batches of the epoch so far (the pool's next slot, one atomic
        read of its counter), counted as ``len(self)`` an epoch: the same on every learner
        whatever its own pace. Slots taken and not yet trained count (a loader's prefetch):
        the learners' schedules run at most that far ahead of their training.
        """
        assert self.pool is not None, "the sampler was closed"
        taken = min(int(self.pool.get(SLOT_NEXT)), self.slots)
        return self.epoch * len(self) + taken * len(self) / max(self.slots, 1)

    def step_scheduler(self, scheduler: Any) -> int:
        """Step a per-step LR ``scheduler`` up to :attr:`position` (see the module docstring).

        Returns:
            The steps the scheduler took: about the number of super-learners after each of
            this learner's steps, 0 now and then on a fast one.
        """
        return step_scheduler(scheduler, self.position)

    def state_dict(self) -> dict[str, Any]:
        """Where the pool stands (collective): every slot below ``slot`` was trained.

        The learners agree on the lowest slot any of them took but did not train (handed to
        its loader, or held); slots below it were all taken, hence trained. At the end of an
        epoch (where ADPSGD's learners meet) that is every slot, and the state is the next
        epoch's start; mid-epoch, slots past it that some learner trained would be trained
        again after a resume.
        """
        assert self.pool is not None, "the sampler was closed"
        mine = min([*self.handed, self.held if self.held is not None else _NONE])
        lowest = min(self.topo.allgather_object(mine))
        taken = int(self.topo.bcast_object(
            int(self.pool.read()[SLOT_NEXT]) if self.topo.rank == 0 else None, root=0))
        slot = min(lowest, taken, self.slots)
        if slot >= self.slots:
            return {"epoch": self.epoch + 1, "slot": 0}
        return {"epoch": self.epoch, "slot": slot}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at :meth:`state_dict`'s point (collective: the pool restarts there)."""
        epoch, slot = int(state["epoch"]), int(state["slot"])
        super().set_epoch(epoch, start_step=0)
        self._restart(slot)
        self._resume = (epoch, slot)

    def close(self) -> None:
        """Release the shared pool (collective); iteration then ends at once."""
        super().close()
        if self.pool is not None:
            self.pool.free()
            self.pool = None


Sampler = ShardSampler | PoolSampler
"""What :meth:`hadpsgd.Distributed.sampler` returns."""


def make_sampler(topo: World, pooled: bool, num_samples: int, batch_size: int,
                 seed: int) -> Sampler:
    """A :class:`PoolSampler` where ``pooled`` (ADPSGD across super-learners), else shards.

    Raises:
        ValueError: For a bad size or seed, or data that do not fill one global batch.
    """
    for name, value, low in (("num_samples", num_samples, 1), ("batch_size", batch_size, 1),
                             ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"sampler: {name} must be an integer >= {low}, got {value!r}")
    if pooled:
        # Checked before the collective window is made: every learner refuses alike.
        ChunkBatchSampler(num_samples, batch_size, topo.rank, topo.size, seed)
        return PoolSampler(topo, num_samples, batch_size, seed)
    return ShardSampler(num_samples, batch_size, topo.rank, topo.size, seed)


__all__ = ["CountedSteps", "PoolSampler", "Sampler", "ShardSampler", "make_sampler",
           "step_scheduler"]
