"""What a deadline leaves behind, process-wide: its errors, the wait loop, the last words.

The errors a missed deadline raises (:class:`CommTimeoutError`, :class:`PeerEndedError`),
:func:`poll`, the loop every non-blocking wait runs under its deadline, the policy for peers
that do not answer (:func:`on_silent_peers`: ``--on-failure continue`` kills a frozen one)
and the ranks so killed, and the line a rank says before the job is ended
(:func:`last_words`, with the notes of :func:`before_abort`). The watchdog that uses them is
:mod:`hadpsgd.comm.deadline`, which re-exports the names its callers took from it before
they moved here (all but :func:`silent_handler`, new with the move).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from hadpsgd import env

DEFAULT_TIMEOUT_S = env.DEFAULT_TIMEOUT_S
"""Deadline in seconds when ``HADPSGD_TIMEOUT`` is not set."""


class CommTimeoutError(RuntimeError):
    """A communication operation did not complete before its deadline.

    Attributes:
        missing: Ranks (of the communicator that timed out, as world ranks) that never
            arrived, when they could be determined.
    """

    def __init__(self, message: str, missing: list[int] | None = None,
                 peer_killed: bool = False) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.peer_killed = peer_killed
        """The silent peers were frozen and are being killed (``--on-failure continue``): a
        peer failure the survivors go on from, not the end of the job."""


class PeerEndedError(CommTimeoutError):
    """A peer this rank waits for has ended its script: the wait can never complete.

    Attributes:
        code: The exit code the peer ended with: the job ends with it, as it would had the
            peer raised.
    """

    def __init__(self, message: str, ended: dict[int, int]) -> None:
        super().__init__(message, missing=sorted(ended))
        self.code = job_code(ended)


def job_code(ended: dict[int, int]) -> int:
    """The code a job ends with when the ranks ``ended`` (rank -> code) left.

    The first non-zero one, else 0.
    """
    return next((c for c in ended.values() if c), 0)


_silent_handler: Callable[[list[int]], bool] | None = None


def on_silent_peers(handler: Callable[[list[int]], bool] | None) -> None:
    """Call ``handler(ranks)`` when peers past a deadline do not answer (dead or frozen).

    ``hadpsgd.comm.ulfm`` sets it under ``--on-failure continue``: a frozen learner is
    killed by a learner on its host, so that MPI's failure mitigation finds it gone and the
    others go on. It returns whether the peers will be killed.
    """
    global _silent_handler  # noqa: PLW0603 - one policy per process
    _silent_handler = handler


def silent_handler() -> Callable[[list[int]], bool] | None:
    """The policy :func:`on_silent_peers` set (None: a silent peer is only named)."""
    return _silent_handler


_killed: list[int] = []
"""The world ranks this process's watchdogs found silent and had killed (see
:func:`on_silent_peers`)."""


def killed_peers() -> list[int]:
    """The peers this process had killed as frozen (an error that follows is their death)."""
    return list(_killed)


def note_killed(ranks: list[int] | None) -> None:
    """Record ``ranks`` as killed by this process as frozen (see :func:`killed_peers`).

    None forgets them all: a new world after a recovery, where they are gone.
    """
    if ranks is None:
        _killed.clear()
    else:
        _killed.extend(ranks)


def timeout_from_env() -> float:
    """The deadline in seconds from env ``HADPSGD_TIMEOUT`` (default 300).

    Kept here (and in :mod:`hadpsgd.comm`) for callers of the communication layer; the parsing
    is :func:`hadpsgd.env.timeout`'s.

    Raises:
        hadpsgd.env.EnvError: If the variable is set but is not a positive number (a
            ``ValueError``, as before).
    """
    return env.timeout()


def poll(done: Callable[[], bool], timeout: float) -> bool:
    """Call ``done()`` until it returns True or ``timeout`` seconds pass; returns the last value.

    It spins (yielding the core between tests) for the first millisecond, where almost every
    operation completes, as a blocking MPI call would; then it sleeps with a growing pause,
    which leaves the cores to the other ranks when a peer is slow or several share a CPU.
    """
    if done():
        return True
    start = time.monotonic()
    spin_until = start + 1e-3
    while time.monotonic() < spin_until:
        if done():
            return True
        os.sched_yield()
    deadline = start + timeout
    pause = 50e-6
    last, longest = start, 0.0
    while not done():
        now = time.monotonic()
        # The monotonic clock runs on while the process is stopped (SIGSTOP, a debugger):
        # a gap far longer than the pause is time this rank itself was not running.
        longest, last = max(longest, now - last), now
        if now > deadline:
            _stall.seconds = longest
            return False
        time.sleep(pause)
        pause = min(pause * 1.5, 1e-3)
    return True


_stall = threading.local()
"""The longest gap between two checks of this thread's last timed-out :func:`poll`."""


def stalled_for() -> float:
    """Seconds this thread was not running during its last timed-out wait (0 if none)."""
    return float(getattr(_stall, "seconds", 0.0))


_BEFORE_ABORT: list[Callable[[str, int], None]] = []
"""Told ``(the line said, the exit code)`` before hadpsgd ends the job (see below)."""


def before_abort(note: Callable[[str, int], None]) -> Callable[[], None]:
    """Have ``note(line, code)`` called before hadpsgd ends the job for a failure.

    Told by :func:`last_words`: the watchdog's thread, where a blocked call can never return
    and no exception reaches the script, and ``hadpsgd.init``'s hook for an exception that
    escapes it. A run directory's record of the end is written here
    (``hadpsgd.Distributed(run_dir=)``). A note that fails is ignored. Returns the call that
    takes the note back.
    """
    _BEFORE_ABORT.append(note)
    return lambda: _BEFORE_ABORT.remove(note) if note in _BEFORE_ABORT else None


def last_words(line: str, code: int) -> None:
    """Say ``line`` (``hadpsgd: ...``) and tell the notes of :func:`before_abort`.

    Each note gets the line without its prefix and ``code``; none stops the abort that follows.
    """
    _say(line)
    for note in list(_BEFORE_ABORT):
        try:
            note(line.removeprefix("hadpsgd: "), code)
        except Exception:  # noqa: BLE001, S110 - the job ends whatever a record does
            pass


def _say(line: str) -> None:
    """Write one line to stderr in a single write call.

    print() writes the text and the newline separately; under MPICH's launcher two ranks'
    lines could interleave between the two.
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


__all__ = ["DEFAULT_TIMEOUT_S", "CommTimeoutError", "PeerEndedError", "before_abort", "job_code",
           "killed_peers", "last_words", "note_killed", "on_silent_peers", "poll",
           "silent_handler", "stalled_for", "timeout_from_env"]
