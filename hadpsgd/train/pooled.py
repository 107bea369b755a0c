"""Epochs of an asynchronous algorithm (ADPSGD): a shared data pool, no global collective.

Every super-learner takes the next slot of batches from one pool (:class:`PooledBatchSampler`
over a :class:`~hadpsgd.comm.counter.SharedCounter`; its leader takes, the members receive the
ticket by an intra-node broadcast), so a slow learner takes fewer and nobody waits for it.
Stop requests, non-finite events and the training loss go into shared counters at the control
points, without any matching call. The learners *meet* (a collective) only where the run needs
them together: at a checkpoint boundary (``--checkpoint-every`` global steps' worth of
slots), at the end of the epoch or of ``--max-steps``, and when a stop request or too many
non-finite steps were seen. At a meeting every slot below :attr:`PooledPlan.pool_next` has been
trained exactly once and none above it, so a checkpoint there resumes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hadpsgd.api.samplers import (
    SLOT_NEXT,
    SLOT_STOP,
)
from hadpsgd.comm import SharedCounter, World
from hadpsgd.data import PooledBatchSampler
from hadpsgd.train.plan import (
    POOL_NEXT,
    POOL_ORDER,
    POOL_SLOT,
    Agree,
    EpochPlan,
    carried_chunks,
    pool_slot_of,
)
from hadpsgd.train.progress import Progress

_NONE = np.iinfo(np.int64).max


def reorder(order: list[int] | None, start: int, trained: set[int],
            slots: int) -> tuple[list[int], int]:
    """The epoch's ticket order after a failure, and the first ticket not yet trained.

    After a failure (``--on-failure continue``) the survivors pool the slots each trained
    since the last meeting (``trained``); every ticket below ``start`` (the last meeting's
    :attr:`PooledPlan.pool_next`) was trained. The new order keeps those, puts the slots the
    survivors trained after them, then every other slot in its old order: first those the dead
    learner had taken (trained or not, its model is gone), then the untaken ones. So every
    slot of the epoch is trained once by the survivors' models, none twice by them.

    Args:
        order: The ticket order so far (None: ticket ``t`` is slot ``t``).
        start: The first ticket not known to be trained by everybody.
        trained: The slots the survivors trained at or after ``start``.
        slots: The slots of the epoch in the survivors' world.

    Returns:
        The new order (a permutation of ``range(slots)``) and the first ticket to hand out.
    """
    old = list(order) if order is not None else list(range(slots))
    old += [s for s in range(len(old), slots)]  # a smaller world may have a longer epoch
    done = old[:start] + [s for s in old[start:] if s in trained]
    new = [s for s in done if s < slots] + [s for s in old[start:] if s not in trained
                                           and s < slots]
    return new, sum(1 for s in done if s < slots)


LOSS_CAP = 1e7
"""The largest loss a learner posts to the shared mean (see :meth:`_Signals.post`)."""


class _Signals:
    """This learner's side of the shared control counters (adds only what is new)."""

    def __init__(self, pool: SharedCounter, control: Any, max_nonfinite: int) -> None:
        self.pool = pool
        self.control = control
        self.max_nonfinite = max_nonfinite
        self.sent_stop = False
        self.sent_nonfinite = len(control.nonfinite)
        self.last_loss = (0, 0)

    def post(self, loss: Any, log: bool) -> tuple[bool, bool, float | None]:
        """Publish this learner's news; returns (stop seen, too many non-finite, mean loss).

        The mean loss is over every learner's losses posted since the last log line (rank 0
        writes it); None when not logging.
        """
        stop = 1 if self.control.stop.requested and not self.sent_stop else 0
        self.sent_stop |= bool(stop)
        nonfinite = len(self.control.nonfinite) - self.sent_nonfinite
        self.sent_nonfinite = len(self.control.nonfinite)
        value = float(loss)
        # In millionths in an int64 counter that adds every learner's posts of the run: a
        # finite loss of a diverging run (4,946 and climbing, then 1e20) would overflow it
        # and end the job with a traceback before the divergence guard could say so. Capped
        # at 1e7, far above any --max-loss-ratio limit, it still trips the guard.
        micro = int(round(min(value, LOSS_CAP) * 1e6)) if log and np.isfinite(value) else 0
        old = self.pool.add([stop, nonfinite, micro, 1 if micro else 0], first=SLOT_STOP)
        stops = int(old[0]) + stop
        total_nonfinite = int(old[1]) + nonfinite
        mean = None
        if log:
            sums = (int(old[2]) + micro, int(old[3]) + (1 if micro else 0))
            count = sums[1] - self.last_loss[1]
            if count > 0:
                mean = (sums[0] - self.last_loss[0]) / count / 1e6
            self.last_loss = sums
        return stops > 0, total_nonfinite > self.max_nonfinite, mean


class PooledPlan(EpochPlan):
    """The epochs of an asynchronous algorithm (see the module docstring).

    Args:
        topo: The learners.
        sampler: The pooled sampler (its ``take`` is :func:`ticket_taker` of ``pool``).
        pool: The shared counters (:data:`POOL_SLOTS` of them).
        opts: The loop's options.
        agree: The loop's blocking agreement, run at every meeting.
        control: The loop's control point (stop flag and non-finite events, posted here).
        metrics: Where the meeting's ``learners`` record goes.
        algo_metrics: The algorithm's own figures for that record.
    """

    meets = True

    def __init__(self, topo: World, sampler: PooledBatchSampler, pool: SharedCounter,
                 opts: Any, agree: Agree, control: Any, metrics: Any,
                 algo_metrics: Callable[[], dict[str, float]]) -> None:
        super().__init__(sampler, opts, agree)
        self.topo = topo
        self.pool: SharedCounter | None = pool
        self._spent = 0  # the pool's crossing bytes once it is freed
        self.control_point = control
        self.metrics = metrics
        self.algo_metrics = algo_metrics
        self.pool_next = 0
        """The first slot of the current epoch not yet trained (all below it are)."""
        self.epoch_base = 0
        self.end = 0
        self.local = 0
        self.last_loss = float("nan")  # a learner that took no batch adds NaN: the guard skips
        self._signals: _Signals | None = None
        self._step = 0
        self._slot = -1
        self.trained: list[int] = []
        """The slots this learner trained since the last meeting (read after a failure)."""
        self.order: list[int] | None = None
        """The interrupted epoch's ticket order after a failure (see :func:`reorder`)."""

    @property
    def pooled(self) -> PooledBatchSampler:
        """The sampler, as the pooled sampler it is."""
        assert isinstance(self.sampler, PooledBatchSampler)
        return self.sampler

    def begin(self, pos: Any) -> None:
        """Every learner starts the epoch at :attr:`pool_next` (collective: resets the pool)."""
        assert self.pool is not None
        sampler = self.pooled
        self.epoch_base = pos.global_step - pos.step_in_epoch
        sampler.set_epoch(pos.epoch)
        sampler.order = self.order
        sampler.held = None
        sampler.handed.clear()
        self.pool.reset([self.pool_next, 0, 0, 0, 0])
        self._signals = _Signals(self.pool, self.control_point, self.opts.max_nonfinite)
        self.local = 0
        self.last_loss = float("nan")
        self.trained.clear()

    def segment(self, pos: Any, loader: Any) -> Iterator[Any] | None:
        """Hand out slots up to the next meeting: a checkpoint, ``--max-steps`` or epoch end.

        A global step is one slot per super-learner, ``num_nodes`` slots.
        """
        per_step = self.topo.num_nodes
        end = self.pooled.slots
        if self.opts.checkpoint_every:
            every = self.opts.checkpoint_every * per_step
            end = min(end, (self.pool_next // every + 1) * every)
        if self.opts.max_steps:
            end = min(end, max(0, self.opts.max_steps - self.epoch_base) * per_step)
        self.end = end
        self.pooled.open(end)
        return iter(loader)

    def locate(self, pos: Any) -> tuple[int, int]:
        """The global step of the slot just handed out, and its key in the chunk trace."""
        sampler = self.pooled
        slot = sampler.handed.popleft()
        self._slot = sampler.slot_of(slot)
        step = self.epoch_base + slot // self.topo.num_nodes + 1
        self._step = step
        trace_key = (pos.epoch * sampler.slots + slot) * self.topo.local_size
        return step, trace_key + self.topo.local_rank

    def current_step(self, pos: Any) -> int:
        """The global step of the slot this learner trained last (agreed only at meetings)."""
        return self._step

    def stepped(self, pos: Any, loss: float) -> int:
        """Count this learner's batches (the position is agreed at the meeting)."""
        self.local += 1
        self.last_loss = loss
        self.trained.append(self._slot)
        return self.local

    def control(self, loss: float, log: bool, progress: Progress, pos: Any, lr: float) -> bool:
        """Post this learner's news to the shared counters; no collective, never stops here.

        A stop request or too many non-finite steps closes the sampler (the leader's; the
        members follow with its refusal ticket), which ends the segment at the next batch.
        """
        assert self._signals is not None
        stop, diverged, mean = self._signals.post(loss, log)
        if mean is not None:
            progress.log(self._step, pos.epoch, lr, mean)
        if (stop or diverged) and self.topo.local_rank == 0:
            self.pooled.close()
        return False

    def segment_over(self, pos: Any) -> bool:
        """Never early: the sampler ends the segment at its meeting point."""
        return False

    def meet(self, pos: Any) -> bool:
        """All learners arrive; agree where the pool stands, log, then agree as usual.

        Every slot below the agreed :attr:`pool_next` was trained once and none above it. The
        agreement is the ordinary, blocking one: it stops or raises on every learner alike (a
        stop request, too many non-finite steps, or the mean of the learners' last losses
        exploding: the divergence guard's training check).
        """
        assert self.pool is not None
        sampler = self.pooled
        held = sampler.held if sampler.held is not None else _NONE
        lowest = min(self.topo.allgather_object(held))  # after it, nobody takes a slot
        taken = int(self.pool.read()[SLOT_NEXT])
        self.pool_next = min(lowest, taken, sampler.slots)
        self.trained.clear()  # every slot below pool_next is trained, none above it
        pos.step_in_epoch = self.pool_next // self.topo.num_nodes
        pos.global_step = self.epoch_base + pos.step_in_epoch
        self._log_learners(pos)
        return self.agree(self.last_loss, None)

    def _log_learners(self, pos: Any) -> None:
        """Every learner's own pace and gossip figures, in a ``learners`` record.

        The training lines carry rank 0's figures only; this record lists, by rank, the
        batches each took this epoch and its exchanges per step and staleness.
        """
        mine = {"batches": self.local, **self.algo_metrics()}
        every = self.topo.allgather_object(mine)
        keys = sorted({k for m in every for k in m})
        self.metrics.write("learners", pos.global_step, epoch=pos.epoch,
                           **{k: [m.get(k) for m in every] for k in keys})

    def epoch_over(self, pos: Any) -> bool:
        """Whether every slot of the epoch was trained."""
        return self.pool_next >= self.pooled.slots

    def at_checkpoint(self, pos: Any) -> bool:
        """Whether the meeting is at a ``--checkpoint-every`` boundary."""
        return bool(self.opts.checkpoint_every) and self.pool_next == self.end

    def end_epoch(self) -> None:
        """The next epoch starts at its first slot, in index order, over all its chunks."""
        super().end_epoch()
        self.pool_next = 0
        self.order = None

    def state_dict(self) -> dict[str, Any]:
        """Where the pool stands: every ticket below it trained (and the order, if changed).

        With the chunks of a slot, so that a run whose slots hold other chunks (another
        super-learner size or ``--batch-size``) or that has no pool knows which were trained.
        """
        state: dict[str, Any] = {**super().state_dict(), POOL_NEXT: self.pool_next,
                                 POOL_SLOT: self.slot_chunks}
        if self.order is not None:
            state[POOL_ORDER] = list(self.order)
        return state

    @property
    def slot_chunks(self) -> int:
        """The chunks of one slot: a batch for each member of a super-learner."""
        return self.pooled.group_size * self.pooled.batch_size

    def load_state_dict(self, state: dict[str, Any], pos: Any) -> None:
        """Restore :meth:`state_dict`, or go on from another plan's or slot size's state.

        A pool whose slots hold the same chunks (the same super-learner size and
        ``--batch-size``, any number of them) takes the tickets as they were: the epoch's
        step counts a slot per super-learner, so the position's step in the epoch is the
        tickets trained over this run's super-learners, and its global step stays (the steps
        after it only go forward). Anything else starts the pool afresh over the chunks the
        state had not trained (:meth:`carry`).
        """
        if pool_slot_of(state) != self.slot_chunks:
            self.carry(state, pos)
            return
        self.sampler.set_trained(carried_chunks(state))
        self.pool_next = int(state[POOL_NEXT])
        order = state.get(POOL_ORDER)
        self.order = [int(s) for s in order] if order is not None else None
        pos.step_in_epoch = self.pool_next // self.topo.num_nodes

    def carry(self, state: dict[str, Any], pos: Any) -> None:
        """Hand out the chunks ``state`` had not trained from the first ticket (see base)."""
        super().carry(state, pos)
        self.pool_next = 0
        self.order = None

    def control_bytes(self) -> int:
        """The pool's operations from another node than rank 0's: tickets, signals (bytes)."""
        return self._spent + (self.pool.crossing_bytes if self.pool is not None else 0)

    def close(self) -> None:
        """Release the shared data pool (collective)."""
        if self.pool is not None:
            self._spent += self.pool.crossing_bytes
            self.pool.free()
            self.pool = None
