"""Deadlines on every blocking wait, so that a dead or missing peer becomes an error, not a hang."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

DEFAULT_TIMEOUT_S = 300.0
"""Deadline in seconds when ``HADPSGD_TIMEOUT`` is not set."""


class CommTimeoutError(RuntimeError):
    """A communication operation did not complete before its deadline."""


def timeout_from_env() -> float:
    """The deadline in seconds from env ``HADPSGD_TIMEOUT`` (default 300).

    Raises:
        ValueError: If the variable is set but is not a positive number.
    """
    raw = os.environ.get("HADPSGD_TIMEOUT")
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"HADPSGD_TIMEOUT={raw!r} is not a number; set it to a deadline in seconds, e.g. 300"
        ) from None
    if value <= 0:
        raise ValueError(f"HADPSGD_TIMEOUT={raw!r} must be > 0 seconds")
    return value


def wait(request: MPI.Request, timeout: float, what: str) -> None:
    """Wait for a non-blocking MPI request, polling until ``timeout`` seconds have passed.

    Polling with a growing sleep (instead of a blocking ``Wait``) is what makes a deadline
    possible at all, and it leaves the cores to the other ranks when several share a CPU.

    Args:
        request: The pending request (e.g. from ``Iallreduce``).
        timeout: Seconds before giving up.
        what: Description of the operation and the peers involved, used in the error.

    Raises:
        CommTimeoutError: If the request is still pending at the deadline.
    """
    if request.Test():
        return
    deadline = time.monotonic() + timeout
    # Spin briefly first: most collectives finish within microseconds of the last arrival.
    for _ in range(200):
        if request.Test():
            return
    pause = 20e-6
    while not request.Test():
        if time.monotonic() > deadline:
            raise CommTimeoutError(
                f"{what} did not complete within {timeout:g} s (HADPSGD_TIMEOUT); a peer is "
                "dead, stuck or never called it. Check the other ranks' logs; raise "
                "HADPSGD_TIMEOUT if the peers are merely slow."
            )
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
