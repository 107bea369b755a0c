"""A frozen learner under ``--on-failure continue``: killed from its own host.

A learner that stops answering (SIGSTOP, a hung driver) is not dead, so ULFM's failure
mitigation never finds it without Open MPI's heartbeat detector. Its peers find it at their
deadline instead; the learners on its host then kill it (and ask each other to, by notes),
and from there it is a dead learner like any other, which the survivors' shrink removes
(:mod:`hadpsgd.comm.ulfm`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from hadpsgd.comm import deadline
from hadpsgd.comm.sentinel import kill_pid, parent_pid

_NOTE_TAG = 4177
"""Tag of "kill this frozen learner" notes to the learners on its host."""
_notes_sent: list[Any] = []  # in-flight notes and their buffers


def kill_frozen_peers(topo: Any) -> None:
    """``--on-failure continue``: a learner that stops answering is killed from its host.

    A frozen learner (SIGSTOP, a hung driver) is not dead: without Open MPI's heartbeat
    detector (which ``hadpsgd.launch`` turns on; a plain ``mpirun --with-ft ulfm`` leaves
    it off) MPI's failure mitigation never finds it. Its peers then find it at their
    deadline (``HADPSGD_TIMEOUT``): it does not answer. Then every learner on its
    host that timed out kills it, and notes to the others on its host ask them to (they may
    not be waiting for it; they read the notes before shrinking, :func:`kill_noted`). Once it
    is gone it is a dead learner like any other. A frozen learner alone on its host cannot be
    killed from here: the job then stops at the deadline, as without the option.
    """
    hosts, pids, me, notes = list(topo.hosts), list(topo.pids), topo.rank, topo._errors
    if notes is None or len(hosts) != topo.size or len(pids) != topo.size:
        return

    def handle(silent: list[int]) -> bool:
        if not all(sum(h == hosts[r] for h in hosts) > 1 for r in silent):
            return False  # one alone on its host: nobody can kill it
        for r in silent:
            if hosts[r] == hosts[me]:
                kill_pid(pids[r])
            for peer in range(len(hosts)):
                if hosts[peer] == hosts[r] and peer not in (r, me):
                    buf = np.array([r], dtype=np.int64)
                    _notes_sent.append((notes.Isend(buf, dest=peer, tag=_NOTE_TAG), buf))
        return True

    deadline.on_silent_peers(handle)


def kill_noted(topo: Any, wait_s: float = 0.1) -> None:
    """Kill the frozen learners on this host that peers named (see :func:`kill_frozen_peers`).

    Called by every survivor before it shrinks the world; waits up to ``wait_s`` for notes
    still on their way.
    """
    notes = topo._errors
    if notes is None:
        return
    buf = np.empty(1, dtype=np.int64)
    # Source by source: after a failure MPI_ANY_SOURCE receives fail (ULFM) until the
    # failure is acknowledged; a dead source fails alone.
    sources = [r for r in range(topo.size) if r != topo.rank]
    end = time.monotonic() + wait_s
    while time.monotonic() < end and sources:
        for source in list(sources):
            try:
                while notes.Iprobe(source=source, tag=_NOTE_TAG):
                    notes.Recv(buf, source=source, tag=_NOTE_TAG)
                    rank = int(buf[0])
                    if 0 <= rank < len(topo.pids) and topo.hosts[rank] == topo.hosts[topo.rank]:
                        kill_pid(topo.pids[rank])
            except Exception:  # noqa: BLE001 - that source is dead: nothing will come from it
                sources.remove(source)
        time.sleep(0.01)


def kill_gone(topo: Any, gone: list[int]) -> None:
    """SIGKILL the learners on this host that the survivors' shrink found ``gone`` (ranks).

    A learner the heartbeat detector declared dead may be frozen, not dead (SIGSTOP, a hung
    driver): the launcher would wait for it at the end of the job forever. Only a process
    that is still this one's sibling (the same parent, the launcher's daemon) is killed: a
    dead learner's process id may already belong to another process.
    """
    me = topo.rank
    for r in gone:
        if r < len(topo.pids) and topo.hosts[r] == topo.hosts[me] and \
                parent_pid(topo.pids[r]) == os.getppid():
            kill_pid(topo.pids[r])
