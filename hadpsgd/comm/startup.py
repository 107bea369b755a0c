"""The deadline of MPI's own start-up (``MPI_Init``), where no MPI deadline can run yet.

``MPI_Init`` waits for every rank of the launch (Open MPI's PMIx fence): a rank that never
reaches it (frozen by SIGSTOP or a debugger, stuck on a file system in its imports, dead
before MPI) leaves every other rank blocked inside it, with no communicator to ask anyone.
:func:`init_thread` therefore calls ``MPI_Init_thread`` through ctypes, which releases the
GIL (mpi4py's own initialisation holds it, so no Python thread could run meanwhile), under a
plain timer thread: past ``HADPSGD_START_TIMEOUT`` (unset: ``HADPSGD_TIMEOUT``) the rank
says which ranks of its host are not in ``MPI_Init`` with it and why (read from ``/proc``:
stopped, in an uninterruptible wait, not started MPI), then exits with
:data:`~hadpsgd.exit_codes.EXIT_TIMED_OUT`. The launcher ends the job when the first rank
exits so (the missing rank included).
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from hadpsgd import env
from hadpsgd.exit_codes import EXIT_TIMED_OUT

LAUNCH_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
"""Where launchers put a process's rank (Open MPI, MPICH Hydra, PMIx, Slurm)."""

_LIBMPI_MAPPED = re.compile(rb"/lib(p?mpi|mpich)[^/]*\.so")

_STATES = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a debugger",
    "D": "in an uninterruptible wait (a stuck file system or device?)",
    "Z": "dead (a zombie: it exited, its launcher has not reaped it yet)",
}
"""What a ``/proc/PID/stat`` state says about a rank that is not where its peers are."""


@dataclass(frozen=True)
class Sibling:
    """Another process of this launch on this host, as ``/proc`` shows it."""

    rank: int
    pid: int
    state: str
    """The kernel's one-letter state (``R``, ``S``, ``D``, ``T``, ``Z``, ...)."""
    mpi_loaded: bool
    """Whether the MPI library is mapped: it has at least started ``MPI_Init``."""

    @property
    def trouble(self) -> str:
        """Why it may hold the others up, or "" if it is waiting with them."""
        if self.state in _STATES:
            return _STATES[self.state]
        if not self.mpi_loaded:
            return "alive, but has not started MPI (still importing or setting up)"
        return ""


def launch_rank(environ: dict[str, str] | None = None) -> int | None:
    """The launch rank in ``environ`` (default: this process's environment), if any."""
    environ = os.environ if environ is None else environ
    for name in LAUNCH_RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _environ(pid: int, proc: str) -> dict[str, str]:
    """Another process's environment at its start (``/proc/PID/environ``)."""
    with open(f"{proc}/{pid}/environ", "rb") as f:
        items = (item.partition(b"=") for item in f.read().split(b"\0"))
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in items}


def _state_and_parent(pid: int, proc: str) -> tuple[str, int]:
    """A process's state letter and parent pid (``/proc/PID/stat``; the name may hold spaces)."""
    with open(f"{proc}/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return fields[0].decode(), int(fields[1])


def siblings(proc: str = "/proc") -> list[Sibling] | None:
    """The other ranks of this launch on this host: the launcher's other children.

    Returns:
        The siblings by rank, or None where ``/proc`` cannot tell (not Linux).
    """
    me, parent = os.getpid(), os.getppid()
    try:
        pids = [int(d) for d in os.listdir(proc) if d.isdigit() and int(d) != me]
    except OSError:
        return None
    found = []
    for pid in pids:
        try:
            state, ppid = _state_and_parent(pid, proc)
            if ppid != parent:
                continue
            rank = launch_rank(_environ(pid, proc))
            if rank is None:
                continue
            with open(f"{proc}/{pid}/maps", "rb") as f:
                loaded = bool(_LIBMPI_MAPPED.search(f.read()))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        found.append(Sibling(rank, pid, state, loaded))
    return sorted(found, key=lambda s: s.rank)


def _merge(before: list[Sibling] | None, now: list[Sibling] | None) -> list[Sibling] | None:
    """``now``, where a rank in trouble ``before`` (stopped, ...) keeps its earlier look."""
    if before is None or now is None:
        return now
    earlier = {s.rank: s for s in before if s.trouble}
    return [earlier.get(s.rank, s) for s in now]


def _gone_from_this_host(found: list[Sibling], environ: dict[str, str] | None = None) -> list[int]:
    """The launch's ranks with no process left, where every rank is on this host.

    Open MPI says how many ranks the launch has and how many of them are on this host: where
    they are the same, a rank neither found in ``/proc`` nor this one has died (before,
    the line said a rank on another host never arrived). Elsewhere nothing: [].
    """
    environ = os.environ if environ is None else environ
    size, local = (environ.get(f"OMPI_COMM_WORLD_{n}SIZE", "") for n in ("", "LOCAL_"))
    me = launch_rank(environ)
    if not size.isdigit() or size != local or me is None:
        return []
    return sorted(set(range(int(size))) - {s.rank for s in found} - {me})


def who_is_missing(found: list[Sibling] | None) -> str:
    """The part of the MPI set-up error that names the ranks holding this host up."""
    if found is None:
        return "some rank never arrived (this host cannot tell which: no /proc)"
    late = [s for s in found if s.trouble]
    if late:
        ranks = ", ".join(str(s.rank) for s in late)
        why = "; ".join(f"rank {s.rank}, pid {s.pid} on this host: {s.trouble}" for s in late)
        return f"rank(s) {ranks} never arrived ({why})"
    gone = _gone_from_this_host(found)
    if gone:
        waiting = ", ".join(str(s.rank) for s in found) or "none"
        return (f"rank(s) {', '.join(map(str, gone))} never arrived (every rank of the launch "
                f"is on this host, and no process of theirs is left: dead; rank(s) {waiting} "
                "of this host are waiting in it too)")
    if not found:
        return "a rank on another host never arrived (this rank is alone on its host)"
    waiting = ", ".join(str(s.rank) for s in found)
    return (f"a rank on another host never arrived (rank(s) {waiting} of this host are "
            "waiting in it too)")


class StartupDeadline:
    """End this process if a block that no MPI deadline covers outlasts ``timeout``.

    ``with StartupDeadline("MPI_Init", 300): ...``: a timer thread waits for the block's end;
    past the deadline it writes one line naming the phase and the ranks of this host that
    hold it up, then exits the process with :data:`EXIT_TIMED_OUT` (the block may be inside
    a C call that never returns). The block must release the GIL while it waits.
    """

    def __init__(self, what: str, timeout: float, rank: int | None = None,
                 setting: str = env.TIMEOUT) -> None:
        self.what = what
        self.timeout = timeout
        self.rank = rank
        self.setting = setting
        """The variable the deadline came from, named in the message."""
        self._done = threading.Event()

    def __enter__(self) -> StartupDeadline:
        if math.isfinite(self.timeout):
            threading.Thread(target=self._watch, name="hadpsgd-startup-deadline",
                             daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        # A first look shortly before the deadline: the first rank to give up makes the
        # launcher wake (SIGCONT) and end the others, so a frozen rank looks alive to a
        # rank whose own deadline comes a moment later.
        early = self.timeout - min(2.0, self.timeout / 4)
        if self._done.wait(early):
            return
        before = siblings()
        if self._done.wait(self.timeout - early):
            return
        found = _merge(before, siblings())
        who = f"rank {self.rank}" if self.rank is not None else "this process"
        line = (f"hadpsgd: error: {who} (start-up: MPI set-up): {self.what} did not complete "
                f"within {self.timeout:g} s ({self.setting}): {who_is_missing(found)}. "
                "A rank that never reaches MPI is frozen, stuck (a file system, its imports) "
                "or dead; see its log. Raise HADPSGD_START_TIMEOUT (MPI's start-up alone) "
                "if ranks are merely slow to start.")
        if self._done.is_set():
            return  # it completed while we looked
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        # As the watchdog does before its abort: the other ranks whose deadline comes a
        # moment later say theirs too (the launcher ends them once this one exits).
        time.sleep(1.0)
        os._exit(EXIT_TIMED_OUT)


def init_thread(MPI: Any, library: str, required: int, timeout: float,  # noqa: N803
                setting: str = env.TIMEOUT) -> None:
    """``MPI_Init_thread`` under :class:`StartupDeadline`, with the GIL released.

    Args:
        MPI: ``mpi4py.MPI``, imported with ``mpi4py.rc.initialize = False``.
        library: The path of the MPI library mpi4py loaded (the same handle is used).
        required: The thread level to ask for.
        timeout: The deadline in seconds (``inf``: none).
        setting: The variable ``timeout`` came from (named when it passes).

    Raises:
        RuntimeError: If ``MPI_Init_thread`` returns an error code.
    """
    init = ctypes.CDLL(library).MPI_Init_thread
    init.restype = ctypes.c_int
    init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                     ctypes.POINTER(ctypes.c_int)]
    provided = ctypes.c_int(-1)
    with StartupDeadline("MPI_Init", timeout, launch_rank(), setting):
        code = init(None, None, required, ctypes.byref(provided))  # ctypes drops the GIL
    if code != 0 or not MPI.Is_initialized():
        raise RuntimeError(f"MPI_Init_thread failed with error code {code}")
