"""The end of a script under ``hadpsgd.init``: every rank meets there, under the deadline.

mpi4py finalizes MPI as the interpreter exits, and ``MPI_Finalize`` waits for every rank: a
rank that never gets there (a deadlock in the user's code) holds the others forever, and
nothing is printed. A rank that leaves early (``sys.exit`` on one rank) leaves its peers
waiting in their next collective until the deadline, which then blames it as "dead or
frozen" and loses its exit code. So, at the end of a script (:func:`meet_at_end`):

- a rank that ends with a non-zero code ends the job at once with that code, as an
  exception does;
- a rank that ends with 0 tells every peer so (a note on the watchdog's control
  communicator, :meth:`~hadpsgd.comm.deadline.Watchdog.announce_end`) and waits for all of
  them at an end meeting (a non-blocking barrier on that communicator) under
  ``HADPSGD_TIMEOUT``; past it, the ranks that did not arrive are named, with what they
  answer they are doing, and the job ends with exit 3 (timed out);
- a peer that waits in a collective the ended rank takes part in learns of the note and ends
  the job at once with the ended rank's code (:class:`~hadpsgd.comm.deadline.PeerEndedError`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from hadpsgd.comm.deadline import CommTimeoutError, poll
from hadpsgd.exit_codes import EXIT_TIMED_OUT

if TYPE_CHECKING:
    from hadpsgd.comm.topology import Topology

END_MEETING = "the end of the script (every rank's exit)"
"""The end meeting's name in a deadline's message."""
_DRAIN_S = 2.0
"""How long the last notes may take to arrive and leave after the meeting (they are in flight
already: the meeting completes only after every rank sent its own)."""


def meet_at_end(topo: Topology, code: int) -> None:
    """End this rank's part of the job: at once with ``code``, or after every rank arrived.

    Args:
        topo: This rank's topology (its watchdog's control communicator carries the notes).
        code: The script's exit code (0 where it ended normally).

    A non-zero ``code`` aborts the job with it (this function does not return). With 0 it
    returns once every rank has reached its end, or aborts the job with exit 3 naming the
    ranks that did not arrive within ``HADPSGD_TIMEOUT``.
    """
    if topo.size == 1:
        return
    watchdog = topo.watchdog
    if code != 0:
        _say(f"hadpsgd: rank {topo.rank}: the script exited with code {code}; ending the job "
             "with that code (as an exception would)")
        topo.abort(code)
        return
    watchdog.activity = "at the end of its script (exit code 0), waiting for the other ranks"
    watchdog.announce_end(code)
    watchdog.seq += 1
    meeting = watchdog.control.Ibarrier()
    if not poll(meeting.Test, watchdog.timeout):
        try:
            watchdog.fail(END_MEETING)
        except CommTimeoutError as err:
            _say(f"hadpsgd: error: {err}")
        topo.abort(EXIT_TIMED_OUT)
        return
    # Every rank sent its note before the meeting: take them off the wire, and let ours
    # leave, so that MPI ends with no message in flight.
    others = topo.size - 1
    poll(lambda: _all_noted(topo, others), _DRAIN_S)


def _all_noted(topo: Topology, others: int) -> bool:
    """Whether every peer's end note arrived and every note of ours left."""
    watchdog = topo.watchdog
    watchdog.take_notes()
    return len(watchdog.ended) >= others and watchdog.finish_notes()


def _say(line: str) -> None:
    """One line to stderr, flushed (a single write: ranks' lines must not interleave)."""
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


__all__ = ["END_MEETING", "meet_at_end"]
