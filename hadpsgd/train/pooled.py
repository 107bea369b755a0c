"""Epochs of an asynchronous algorithm (ADPSGD): a shared data pool, no global collective.

Every super-learner takes the next slot of batches from one pool (:class:`PooledBatchSampler`
over a :class:`~hadpsgd.comm.counter.SharedCounter`; its leader takes, the members receive the
ticket by an intra-node broadcast), so a slow learner takes fewer and nobody waits for it.
Stop requests, non-finite events and the training loss go into shared counters at the control
points, without any matching call. The learners *meet* (a collective) only where the run needs
them together: at a checkpoint boundary (``--checkpoint-every`` global steps' worth of
slots), at the end of the epoch or of ``--max-steps``, and when a stop request or too many
non-finite steps were seen. At a meeting every slot below :attr:`Trainer.pool_next` has been
trained exactly once and none above it, so a checkpoint there resumes exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from hadpsgd.comm import SharedCounter, Topology
from hadpsgd.data import PooledBatchSampler


class Trainer(Protocol):
    """What the pooled epoch uses of :class:`hadpsgd.train.loop.Trainer`.

    That class imports this module: a protocol instead of an import keeps the two free of a
    circle.
    """

    topo: Topology
    pool: SharedCounter | None
    sampler: Any
    loader: Any
    opts: Any
    pos: Any
    control: Any
    algo: Any
    metrics: Any
    pool_next: int
    lr: float

    @property
    def nonfinite(self) -> list[tuple[int, str]]: ...  # noqa: D102

    def start_epoch(self) -> Any: ...  # noqa: D102

    def train_step(self, feats: Any, labels: Any, step: int, trace_step: int) -> Any: ...  # noqa: D102

    def agree(self, loss: Any, progress: Any = None) -> bool: ...  # noqa: D102

    def checkpoint(self) -> Any: ...  # noqa: D102

SLOT_NEXT, SLOT_STOP, SLOT_NONFINITE, SLOT_LOSS, SLOT_LOGGED = range(5)
POOL_SLOTS = 5
"""Shared counters: next free data slot, stop requests, non-finite events, loss sum (in
micro-nats) and the number of losses in it."""
_NONE = np.iinfo(np.int64).max


def ticket_taker(topo: Topology, pool: SharedCounter,
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


class _Signals:
    """This learner's side of the shared control counters (adds only what is new)."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.sent_stop = False
        self.sent_nonfinite = len(trainer.nonfinite)
        self.last_loss = (0, 0)

    def post(self, loss: Any, log: bool) -> tuple[bool, bool, float | None]:
        """Publish this learner's news; returns (stop seen, too many non-finite, mean loss).

        The mean loss is over every learner's losses posted since the last log line (rank 0
        writes it); None when not logging.
        """
        t = self.t
        stop = 1 if t.control.stop.requested and not self.sent_stop else 0
        self.sent_stop |= bool(stop)
        nonfinite = len(t.nonfinite) - self.sent_nonfinite
        self.sent_nonfinite = len(t.nonfinite)
        value = float(loss)
        micro = int(round(value * 1e6)) if log and np.isfinite(value) else 0
        old = t.pool.add([stop, nonfinite, micro, 1 if micro else 0], first=SLOT_STOP)
        stops = int(old[0]) + stop
        total_nonfinite = int(old[1]) + nonfinite
        mean = None
        if log:
            sums = (int(old[2]) + micro, int(old[3]) + (1 if micro else 0))
            count = sums[1] - self.last_loss[1]
            if count > 0:
                mean = (sums[0] - self.last_loss[0]) / count / 1e6
            self.last_loss = sums
        return stops > 0, total_nonfinite > t.opts.max_nonfinite, mean


def _segment_end(t: Trainer, sampler: PooledBatchSampler, epoch_base: int) -> int:
    """The slot where the learners meet next: a checkpoint, ``--max-steps`` or the epoch end.

    A global step is one slot per super-learner, ``num_nodes`` slots.
    """
    per_step = t.topo.num_nodes
    end = sampler.slots
    if t.opts.checkpoint_every:
        every = t.opts.checkpoint_every * per_step
        end = min(end, (t.pool_next // every + 1) * every)
    if t.opts.max_steps:
        end = min(end, max(0, t.opts.max_steps - epoch_base) * per_step)
    return end


def _meet(t: Trainer, sampler: PooledBatchSampler, epoch_base: int) -> None:
    """All learners arrive; agree where the pool stands (every slot below it trained)."""
    assert t.pool is not None
    held = sampler.held if sampler.held is not None else _NONE
    lowest = min(t.topo.allgather_object(held))  # after it, nobody takes a slot any more
    taken = int(t.pool.read()[SLOT_NEXT])
    t.pool_next = min(lowest, taken, sampler.slots)
    t.pos.step_in_epoch = t.pool_next // t.topo.num_nodes
    t.pos.global_step = epoch_base + t.pos.step_in_epoch


def _log_learners(t: Trainer, batches: int) -> None:
    """At a meeting (a collective anyway): every learner's own pace and gossip figures.

    The training lines carry rank 0's figures only; this ``learners`` record lists, by rank,
    the batches each took this epoch and its exchanges per step and staleness.
    """
    mine = {"batches": batches, **t.algo.metrics()}
    every = t.topo.allgather_object(mine)
    keys = sorted({k for m in every for k in m})
    t.metrics.write("learners", t.pos.global_step, epoch=t.pos.epoch,
                    **{k: [m.get(k) for m in every] for k in keys})


def run_pooled_epoch(t: Trainer) -> None:
    """Train the current epoch from the shared pool (see the module docstring)."""
    sampler = t.sampler
    assert isinstance(sampler, PooledBatchSampler) and t.pool is not None
    epoch_base = t.pos.global_step - t.pos.step_in_epoch
    sampler.set_epoch(t.pos.epoch)
    sampler.held = None
    sampler.handed.clear()
    t.pool.reset([t.pool_next, 0, 0, 0, 0])  # collective: every learner starts the epoch here
    signals = _Signals(t)
    progress = t.start_epoch()
    local = 0
    last_loss = float("nan")  # a learner that took no batch adds NaN: the guard skips it
    while True:
        end = _segment_end(t, sampler, epoch_base)
        sampler.open(end)
        for feats, labels in t.loader:
            local += 1
            slot = sampler.handed.popleft()
            step = epoch_base + slot // t.topo.num_nodes + 1  # the global step of this batch
            trace_key = (t.pos.epoch * sampler.slots + slot) * t.topo.local_size
            loss = t.train_step(feats, labels, step, trace_key + t.topo.local_rank)
            last_loss = loss
            progress.step()
            log = local % t.opts.log_every == 0
            if log or local % t.opts.control_every == 0:
                stop, diverged, mean = signals.post(loss, log)
                if mean is not None:
                    progress.log(step, t.pos.epoch, t.lr, mean)
                if (stop or diverged) and t.topo.local_rank == 0:
                    sampler.close()  # the members follow with the leader's refusal ticket
        _meet(t, sampler, epoch_base)
        _log_learners(t, local)
        # The meeting's agreement is the ordinary, blocking one: it stops or raises on every
        # learner alike (a stop request, too many non-finite steps, or the mean of the
        # learners' last losses exploding: the divergence guard's training check).
        if t.agree(last_loss):
            break
        if t.pool_next >= sampler.slots:
            break  # the epoch is done
        if t.opts.max_steps and t.pos.global_step >= t.opts.max_steps:
            break
        if t.opts.checkpoint_every and t.pool_next == end:
            t.checkpoint()  # a --checkpoint-every boundary, every slot below it trained
    progress.close()
