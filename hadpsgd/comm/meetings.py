"""The meetings of the in-process world (:mod:`hadpsgd.comm.threads`).

Groups of learner threads, shared counters and the gossip's pair channel. A :class:`Group`
is a barrier with a slot per member: a collective leaves each member's value and reads
everyone's. The counters and the pair channel are the thread world's stand-ins for MPI's
one-sided windows (:class:`~hadpsgd.comm.SharedCounter`) and ``PairChannel``, with the same
calls, so ADPSGD's pool and gossip thread run on them unchanged.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hadpsgd.comm.counter import CounterReads
from hadpsgd.comm.deadline import CommTimeoutError


class Group:
    """Learners (world ranks) that meet at one barrier, a slot each."""

    def __init__(self, members: list[int], timeout: float) -> None:
        self.members = members
        self.barrier = threading.Barrier(len(members), timeout=timeout)
        self.slots: list[Any] = [None] * len(members)
        self.doing = ["start-up"] * len(members)

    def meet(self, rank: int, value: Any, what: str) -> list[Any]:
        """Leave ``value``, read every member's (in member order), then part together."""
        index = self.members.index(rank)
        self.slots[index] = value
        self.doing[index] = what
        try:
            self.barrier.wait()
            seen = list(self.slots)
            self.barrier.wait()  # nobody leaves a new value before everyone has read
        except threading.BrokenBarrierError:
            late = [m for m, d in zip(self.members, self.doing, strict=True) if d != what]
            raise CommTimeoutError(f"{what}: learner(s) {late or '?'} of {self.members} never "
                                   "arrived (or one failed)", missing=late) from None
        return seen


def _made_together(group: Group, rank: int, make: Callable[[], Any], what: str) -> Any:
    """One object for the whole group, made by its first member (a collective creation)."""
    first = group.members[0] == rank
    return group.meet(rank, make() if first else None, what)[0]


class _Watchdog:
    """What a channel's user waits with: polls a completion test up to the deadline."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def wait_until(self, done: Callable[[], bool], what: str,
                   group: list[int] | None = None) -> None:
        """Wait for ``done()``; past the deadline, :class:`CommTimeoutError` naming ``group``."""
        end = time.monotonic() + self.timeout
        while not done():
            if time.monotonic() > end:
                raise CommTimeoutError(f"{what}: not done within {self.timeout} s (rank(s) "
                                       f"{group or '?'})", missing=list(group or []))
            time.sleep(0.0005)


class _CounterState:
    def __init__(self, slots: int) -> None:
        self.lock = threading.Lock()
        self.values = np.zeros(slots, dtype=np.int64)


class ThreadCounter(CounterReads):
    """:class:`~hadpsgd.comm.SharedCounter`'s calls on lock-guarded slots its group shares.

    Made collectively (every member of ``group``); :meth:`reset` and :meth:`free` are
    collective too, every other call is one learner's alone, as with MPI's one-sided atomics.
    """

    def __init__(self, group: Group, rank: int, slots: int, crossing: bool = False) -> None:
        self._group, self._rank, self.slots = group, rank, slots
        self.crossing = crossing
        self.crossing_bytes = 0
        self._state: _CounterState = _made_together(group, rank, lambda: _CounterState(slots),
                                                    "shared counter set-up")

    def add(self, values: list[int] | np.ndarray, first: int = 0) -> np.ndarray:
        """Atomically add ``values`` to slots ``first...``; the slots' old values."""
        add = np.asarray(values, dtype=np.int64)
        with self._state.lock:
            old = self._state.values[first:first + add.size].copy()
            self._state.values[first:first + add.size] += add
        self.tally(first, add.size)  # as SharedCounter counts
        return old

    def compare_and_swap(self, slot: int, expected: int, new: int) -> int:
        """Atomically set ``slot`` to ``new`` if it holds ``expected``; its old value."""
        self.tally(slot, 1, compare=True)
        with self._state.lock:
            old = int(self._state.values[slot])
            if old == expected:
                self._state.values[slot] = new
        return old

    def reset(self, values: list[int] | np.ndarray) -> None:
        """Set every slot (collective: nobody updates them meanwhile)."""
        self._group.meet(self._rank, None, "shared counter reset (enter)")
        if self._group.members[0] == self._rank:
            with self._state.lock:
                self._state.values[:] = np.asarray(values, dtype=np.int64)
        self._group.meet(self._rank, None, "shared counter reset (leave)")

    def free(self) -> None:
        """Release it (collective)."""
        self._group.meet(self._rank, None, "shared counter free")


class ThreadSlots(ThreadCounter):
    """A :class:`ThreadCounter` whose slot ``own`` is this member's: the others' cross nodes.

    Counts the bytes :class:`~hadpsgd.comm.counter.OwnedSlots` counts for the same calls.
    """

    def __init__(self, group: Group, rank: int, slots: int, own: int) -> None:
        super().__init__(group, rank, slots)
        self.own = own

    def crosses(self, slot: int) -> bool:
        """Whether ``slot`` is another member's."""
        return slot != self.own


class _Mailboxes:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.boxes: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
        self.arrived: dict[int, int] = {}


class _Arrival:
    """A non-blocking barrier in flight (``PairRequest``'s :meth:`done`)."""

    def __init__(self, boxes: _Mailboxes, number: int, size: int) -> None:
        self._boxes, self._number, self._size = boxes, number, size

    def done(self) -> bool:
        """Whether every member of the channel has started this barrier."""
        with self._boxes.cond:
            return self._boxes.arrived.get(self._number, 0) >= self._size


class ThreadPairChannel:
    """The gossip's pair channel in a thread world: a mailbox per ordered pair and tag.

    Its ranks are its group's members in order (the node index, for the leaders' channel),
    as with MPI's ``PairChannel``; made collectively over the group.
    """

    def __init__(self, group: Group, rank: int, timeout: float) -> None:
        self._group, self._world_rank = group, rank
        self.rank, self.size = group.members.index(rank), len(group.members)
        self.world_ranks = list(group.members)
        self.watchdog = _Watchdog(timeout)
        self._boxes: _Mailboxes = _made_together(group, rank, _Mailboxes, "pair channel set-up")
        self._barriers = 0

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0,
                 what: str | None = None, progress: Callable[[], None] | None = None) -> None:
        """Leave ``send`` for ``peer``, take ``peer``'s into ``recv`` (both call it)."""
        if send.numel() != recv.numel() or send.dtype != recv.dtype:
            raise ValueError("exchange: send and recv must have the same size and dtype")
        boxes, who = self._boxes, self.world_ranks[peer]
        end = time.monotonic() + self.watchdog.timeout
        with boxes.cond:
            boxes.boxes.setdefault((self.rank, peer, tag), deque()).append(send.clone())
            boxes.cond.notify_all()
            while not boxes.boxes.get((peer, self.rank, tag)):
                # A learner that failed breaks its job's meetings (ThreadJob.break_all): the
                # partner of a swap then ends now, as MPI's abort ends it, not at its deadline.
                if self._group.barrier.broken:
                    raise CommTimeoutError(f"{what or 'pair exchange'}: a learner failed "
                                           f"while rank {who} was awaited", missing=[who])
                left = end - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"{what or 'pair exchange'}: rank {who} never sent "
                                           f"within {self.watchdog.timeout} s", missing=[who])
                boxes.cond.wait(min(left, 0.05))
            recv.copy_(boxes.boxes[(peer, self.rank, tag)].popleft())

    def board(self, slots: int) -> ThreadSlots:
        """A pairing board, one slot per member (collective over the channel).

        Like :class:`~hadpsgd.comm.counter.OwnedSlots`, it counts an operation on another
        member's slot as crossing nodes.
        """
        return ThreadSlots(self._group, self._world_rank, slots, own=self.rank)

    def start_barrier(self) -> _Arrival:
        """Begin a non-blocking barrier over the channel."""
        self._barriers += 1
        with self._boxes.cond:
            self._boxes.arrived[self._barriers] = self._boxes.arrived.get(self._barriers, 0) + 1
        return _Arrival(self._boxes, self._barriers, self.size)


__all__ = ["Group", "ThreadCounter", "ThreadPairChannel"]
