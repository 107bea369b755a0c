"""``--on-failure continue``: a learner stopped on this host is found in seconds and killed.

A frozen learner (SIGSTOP, a job-control stop) is alive, so MPI's failure mitigation never
reports it; its peers used to find it only at their deadline (``HADPSGD_TIMEOUT``, 300 s by
default, which slow collectives need), and Open MPI's own heartbeat detector, which finds it
in 2 s, crashes about one launch in seven inside ``MPI_Init`` (docs/failures.md), so it is
off by default. A :class:`Sentinel` needs neither: a thread of every learner reads the state
of its host's other learners' processes from ``/proc`` twice a second (no message, no MPI
call) and kills one that has been stopped for ``HADPSGD_FROZEN_S`` seconds (5 by default).
From then on it is a dead learner like any other: the survivors' next operation with it
fails and they go on without it. Only a sibling process (the same parent: the launcher's
daemon on this host) is killed, so a process id that was reused is never hit.

What it does not find: a learner alone on its host (nobody there to read its state; it is
found at the deadline, where the others' shrink gives up, as before), a process stopped by
a debugger (``t``, traced: left alone on purpose) or one whose main thread hangs while its
other threads run (its watchdog still answers: the deadline names what it is doing).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

PERIOD_S = 0.5
"""How often the host's learners' states are read."""


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, None where it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return stat.rsplit(")", 1)[1].split()


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from ``/proc`` (``R``, ``S``, ``T``...), None if gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def parent_pid(pid: int) -> int | None:
    """The parent process id of ``pid`` (None where it is gone or cannot be read)."""
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def kill_pid(pid: int) -> None:
    """SIGKILL ``pid`` (a frozen learner), if it is still there."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Sentinel:
    """Watches this host's other learners and kills one stopped for ``frozen_s`` seconds.

    Args:
        rank: This learner's rank (for the line it prints).
        siblings: The rank and process id of every other learner on this host.
        frozen_s: Seconds a learner may stay stopped (SIGSTOP) before it is killed.
        on_kill: Told the ranks killed (the deadline's record: an error of a call the death
            cut is that death).
        period: Seconds between two reads of the states.
        parent: The process id a sibling's parent must be (default this process's parent:
            the launcher's daemon on this host).
    """

    def __init__(self, rank: int, siblings: dict[int, int], frozen_s: float,
                 on_kill: Callable[[list[int]], None], period: float = PERIOD_S,
                 parent: int | None = None) -> None:
        self.rank, self.siblings, self.frozen_s = rank, dict(siblings), frozen_s
        self.on_kill, self.period = on_kill, period
        self.parent = os.getppid() if parent is None else parent
        self.killed: list[int] = []
        self._stopped_since: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Sentinel:
        """Start the watching thread (a daemon: it never holds the process up); returns self."""
        if self.siblings and self.frozen_s > 0:
            self._thread = threading.Thread(target=self._run, name="hadpsgd-sentinel",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a new world after a recovery gets a new sentinel)."""
        self._stop.set()

    def check(self, now: float) -> list[int]:
        """Read every sibling's state once at time ``now``; kill and return the frozen ones."""
        frozen = []
        for rank, pid in list(self.siblings.items()):
            state = process_state(pid)
            if state != "T":  # running, sleeping, traced by a debugger, or gone
                self._stopped_since.pop(rank, None)
                if state is None:
                    self.siblings.pop(rank)
                continue
            since = self._stopped_since.setdefault(rank, now)
            if now - since >= self.frozen_s and parent_pid(pid) == self.parent:
                frozen.append(rank)
        if frozen:
            self.on_kill(frozen)
            for rank in frozen:
                kill_pid(self.siblings.pop(rank))
                self._stopped_since.pop(rank, None)
            self.killed.extend(frozen)
            who = ", ".join(f"rank {r}" for r in frozen)
            sys.stderr.write(
                f"[hadpsgd] note: rank {self.rank}: {who} on this host stopped (SIGSTOP) for "
                f"{self.frozen_s:g} s: killed, so that the others go on (HADPSGD_FROZEN_S)\n")
            sys.stderr.flush()
        return frozen

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.check(time.monotonic())


__all__ = ["Sentinel", "kill_pid", "parent_pid", "process_state"]
