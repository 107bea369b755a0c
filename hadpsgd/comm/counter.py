"""Shared counters: a few int64 slots on rank 0 that every rank updates without a collective.

MPI one-sided atomics (``Fetch_and_op`` / ``Get_accumulate`` under a shared ``Lock_all``)
need no matching call on the other ranks, so a fast learner never waits for a slow one. ADPSGD
uses them for its work-conserving data pool (each learner takes the next batch index at its
own pace) and for its control signals (stop requests, non-finite events, the training loss).
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


class SharedCounter(CounterReads):
    """``slots`` int64 counters in a window on rank 0 of ``comm``.

    Create it collectively (every rank of ``comm``); :meth:`reset` and :meth:`free` are
    collective too, every other method is one-sided.

    Args:
        comm: The communicator (a private duplicate: its window belongs to this object).
        watchdog: Deadline keeper of the collective calls.
        slots: Number of counters.
    """

    def __init__(self, comm: Any, watchdog: Watchdog, slots: int) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.watchdog = watchdog
        self.slots = slots
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
        return old

    def compare_and_swap(self, slot: int, expected: int, new: int) -> int:
        """Atomically set ``slot`` to ``new`` if it holds ``expected``; return its old value."""
        MPI = self._mpi  # noqa: N806
        i64 = MPI.INT64_T
        old = np.empty(1, dtype=np.int64)
        self.win.Compare_and_swap([np.array([new], dtype=np.int64), i64],
                                  [np.array([expected], dtype=np.int64), i64],
                                  [old, i64], 0, slot)
        self.win.Flush(0)
        return int(old[0])

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
