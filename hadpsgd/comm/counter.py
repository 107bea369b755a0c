"""Shared counters: a few int64 slots on rank 0 that every rank updates without a collective.

MPI one-sided atomics (``Fetch_and_op`` / ``Get_accumulate`` under a shared ``Lock_all``)
need no matching call on the other ranks, so a fast learner never waits for a slow one. ADPSGD
uses them for its work-conserving data pool (each learner takes the next batch index at its
own pace) and for its control signals (stop requests, non-finite events, the training loss);
its gossip pairs up on :class:`OwnedSlots`, one slot per leader in the leader's own memory, so
that waiting for a partner reads local memory and only a claim crosses to a neighbour.

Each counts the bytes its operations carry to and from another node (operands, compare
values and returned values; not the transport's headers): ``crossing_bytes``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hadpsgd.comm.deadline import Watchdog


class CounterReads:
    """What every kind of shared counter derives from its atomic :meth:`add`.

    The MPI one below and the thread world's :class:`~hadpsgd.comm.meetings.ThreadCounter`.
    """

    slots: int
    crossing_bytes: int = 0
    """Bytes this rank's operations carried to and from slots on another node so far."""
    crossing: bool = False
    """Whether the slots are on another node than this rank (rank 0's window)."""

    def crosses(self, slot: int) -> bool:
        """Whether an operation on ``slot`` crosses nodes (here: all of them or none)."""
        return self.crossing

    def tally(self, slot: int, values: int, compare: bool = False) -> None:
        """Count an operation on ``values`` slots from ``slot`` if it crosses nodes.

        Its operands go out and the old values come back, 8 bytes each; a compare-and-swap
        sends its expected value too. Not the transport's headers.
        """
        if self.crosses(slot):
            self.crossing_bytes += 8 * values * (3 if compare else 2)

    def add(self, values: list[int] | np.ndarray, first: int = 0) -> np.ndarray:
        """Atomically add ``values`` to slots ``first...`` and return the slots' old values."""
        raise NotImplementedError

    def get(self, slot: int) -> int:
        """The current value of one slot (an atomic read)."""
        return int(self.add([0], first=slot)[0])

    def take(self, slot: int = 0) -> int:
        """Atomically increment ``slot`` and return its value before (a ticket)."""
        return int(self.add([1], first=slot)[0])

    def read(self) -> np.ndarray:
        """The current value of every slot (one atomic read)."""
        return self.add(np.zeros(self.slots, dtype=np.int64))


def _compare_and_swap(mpi: Any, win: Any, rank: int, slot: int, expected: int,
                      new: int) -> int:
    """One atomic compare-and-swap on int64 ``slot`` of ``rank``'s part of ``win``."""
    i64 = mpi.INT64_T  # one datatype on both sides: MPI requires the same basic type
    old = np.empty(1, dtype=np.int64)
    win.Compare_and_swap([np.array([new], dtype=np.int64), i64],
                         [np.array([expected], dtype=np.int64), i64], [old, i64], rank, slot)
    win.Flush(rank)
    return int(old[0])


class SharedCounter(CounterReads):
    """``slots`` int64 counters in a window on rank 0 of ``comm``.

    Create it collectively (every rank of ``comm``); :meth:`reset` and :meth:`free` are
    collective too, every other method is one-sided.

    Args:
        comm: The communicator (a private duplicate: its window belongs to this object).
        watchdog: Deadline keeper of the collective calls.
        slots: Number of counters.
        crossing: Whether rank 0 is on another node than this rank (its operations then
            count in :attr:`crossing_bytes`).
    """

    def __init__(self, comm: Any, watchdog: Watchdog, slots: int,
                 crossing: bool = False) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.watchdog = watchdog
        self.slots = slots
        self.crossing = crossing
        self.crossing_bytes = 0
        size = slots * 8 if comm.Get_rank() == 0 else 0
        self.win = MPI.Win.Allocate(size, disp_unit=8, comm=comm)
        if comm.Get_rank() == 0:
            np.frombuffer(self.win.tomemory(), dtype=np.int64)[:] = 0
        self.watchdog.wait(comm.Ibarrier(), "shared counter set-up")
        self.win.Lock_all()

    def add(self, values: list[int] | np.ndarray, first: int = 0) -> np.ndarray:
        """Atomically add ``values`` to slots ``first...`` and return the slots' old values."""
        MPI = self._mpi  # noqa: N806
        add = np.asarray(values, dtype=np.int64)
        old = np.empty_like(add)
        i64 = MPI.INT64_T  # one datatype on both sides: MPI requires the same basic type
        if add.size == 1:
            self.win.Fetch_and_op([add, i64], [old, i64], 0, first, MPI.SUM)
        else:
            self.win.Get_accumulate([add, i64], [old, i64], 0,
                                    target=(first, add.size, i64), op=MPI.SUM)
        self.win.Flush(0)
        self.tally(first, add.size)
        return old

    def compare_and_swap(self, slot: int, expected: int, new: int) -> int:
        """Atomically set ``slot`` to ``new`` if it holds ``expected``; return its old value."""
        old = _compare_and_swap(self._mpi, self.win, 0, slot, expected, new)
        self.tally(slot, 1, compare=True)
        return old

    def reset(self, values: list[int] | np.ndarray) -> None:
        """Set every slot (collective: nobody updates them meanwhile)."""
        self.watchdog.wait(self.comm.Ibarrier(), "shared counter reset (enter)")
        if self.comm.Get_rank() == 0:
            new = np.asarray(values, dtype=np.int64)
            i64 = self._mpi.INT64_T
            self.win.Put([new, i64], 0, target=(0, new.size, i64))
            self.win.Flush(0)
        self.watchdog.wait(self.comm.Ibarrier(), "shared counter reset (leave)")

    def free(self) -> None:
        """Release the window (collective)."""
        self.win.Unlock_all()
        self.win.Free()


class OwnedSlots(CounterReads):
    """One int64 slot per rank of ``comm``, slot ``j`` in rank ``j``'s own window.

    ADPSGD's pairing board (:mod:`hadpsgd.algorithms.gossip`): a leader waiting for a
    partner reads its own slot, which is local memory and crosses no link, however long it
    waits; only claiming a neighbour (one compare-and-swap on the neighbour's slot) crosses.
    On one board on rank 0 every wait was a poll across the link, which on two emulated
    hosts carried more bytes than the gossip itself (issue 57). Create it collectively;
    :meth:`free` is collective too, every other method is one-sided.

    Every rank of ``comm`` is a node of its own (the pair channel's super-learners): an
    operation on another rank's slot counts in :attr:`crossing_bytes`.

    Args:
        comm: The communicator (a private duplicate: its window belongs to this object).
        watchdog: Deadline keeper of the collective calls.
    """

    def __init__(self, comm: Any, watchdog: Watchdog) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.watchdog = watchdog
        self.slots = comm.Get_size()
        self.rank = comm.Get_rank()
        self.crossing_bytes = 0
        self.win = MPI.Win.Allocate(8, disp_unit=8, comm=comm)
        np.frombuffer(self.win.tomemory(), dtype=np.int64)[:] = 0
        self.watchdog.wait(comm.Ibarrier(), "pairing board set-up")
        self.win.Lock_all()

    def crosses(self, slot: int) -> bool:
        """Whether ``slot`` is another rank's (every rank a node of its own)."""
        return slot != self.rank

    def add(self, values: list[int] | np.ndarray, first: int = 0) -> np.ndarray:
        """Atomically add ``values[0]`` to slot ``first`` (one slot a call); its old value."""
        MPI = self._mpi  # noqa: N806
        add = np.asarray(values, dtype=np.int64)
        if add.size != 1:
            raise ValueError(f"OwnedSlots: one slot a call (each lives on its own rank), got "
                             f"{add.size}")
        old = np.empty_like(add)
        i64 = MPI.INT64_T
        self.win.Fetch_and_op([add, i64], [old, i64], first, 0, MPI.SUM)
        self.win.Flush(first)
        self.tally(first, 1)
        return old

    def read(self) -> np.ndarray:
        """Every slot (one atomic read each)."""
        return np.array([self.get(j) for j in range(self.slots)], dtype=np.int64)

    def compare_and_swap(self, slot: int, expected: int, new: int) -> int:
        """Atomically set ``slot`` to ``new`` if it holds ``expected``; return its old value."""
        old = _compare_and_swap(self._mpi, self.win, slot, 0, expected, new)
        self.tally(slot, 1, compare=True)
        return old

    def free(self) -> None:
        """Release the window (collective)."""
        self.win.Unlock_all()
        self.win.Free()
