"""Every exit code of ``python -m hadpsgd.run``, in one place.

Scripts (the sweep tool, the soak, job schedulers' retry rules) read a run's outcome from
its exit code, never from its log: import these names rather than repeating the numbers.
"""

from __future__ import annotations

__all__ = ["DESCRIPTIONS", "EXIT_DIVERGED", "EXIT_FAILED", "EXIT_OK", "EXIT_STOPPED",
           "EXIT_TIMED_OUT", "EXIT_USER_ERROR", "describe"]

EXIT_OK = 0
"""Trained to the end."""
EXIT_FAILED = 1
"""A failure while training (a bug: then with its traceback; a full disk; too few learners
left under ``--on-failure continue``)."""
EXIT_USER_ERROR = 2
"""Bad flag, file, layout or checkpoint, found before training: nothing was trained."""
EXIT_TIMED_OUT = 3
"""A peer never arrived within ``HADPSGD_TIMEOUT`` (dead, frozen or stuck), in start-up or
training, whether the wait was polled or the watchdog aborted a blocking call
(:mod:`hadpsgd.comm.deadline`, :mod:`hadpsgd.comm.startup`): one line per rank names it."""
EXIT_DIVERGED = 4
"""The run diverged and stopped: more than ``--max-nonfinite`` non-finite steps, or a finite
loss past ``--max-loss-ratio`` times its start."""
EXIT_STOPPED = 75
"""Stopped on request (a signal) with a checkpoint written (``EX_TEMPFAIL``): run again with
``--resume auto`` to continue."""

DESCRIPTIONS = {
    EXIT_OK: "ok",
    EXIT_FAILED: "failed",
    EXIT_USER_ERROR: "user error",
    EXIT_TIMED_OUT: "timed out",
    EXIT_DIVERGED: "diverged",
    EXIT_STOPPED: "stopped",
}
"""A word for each exit code."""


def describe(code: int) -> str:
    """A word for a run's exit code (``killed by signal N`` for a negative or 128+N one)."""
    if code in DESCRIPTIONS:
        return DESCRIPTIONS[code]
    if code < 0:
        return f"killed by signal {-code}"
    if code > 128:
        return f"killed by signal {code - 128}"
    return f"exit {code}"
