"""Whether a rank's output reaches a terminal: a progress bar there, plain lines in a file.

A rank cannot just ask its own streams. Open MPI's ``mpirun`` gives every rank a pty as its
stdout, whatever the user redirected, and a pipe as its stderr, also when the user's is a
terminal; tqdm draws on stderr, the log lines go to stdout. So under a launcher the streams
that count are the launcher's, which a local rank's parent is: this module reads where its
stdout and stderr lead (``/proc/PID/fd``). ``python -m hadpsgd.launch`` says it outright
(``HADPSGD_STDOUT_TTY``), which :func:`hadpsgd.train.progress.on_terminal` asks first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "prte")
"""Names of the processes that launch ranks on their own host and pass on their output
(Open MPI 4 and 5; MPICH's ``mpiexec``): a local rank's parent. A remote rank's parent is a
daemon (``prted``, ``orted``, ``hydra_pmi_proxy``), whose streams say nothing of the user's."""

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
"""Set in a process that an MPI launcher started (Open MPI, PMIx, MPICH Hydra)."""

_TERMINALS = ("/dev/pts/", "/dev/tty", "/dev/console")
"""Where a terminal's file descriptor leads (a Unix pseudo-terminal or a console)."""


def under_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a rank an MPI launcher started."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in RANK_VARIABLES)


def leads_to_terminal(target: str) -> bool:
    """Whether a file descriptor's ``/proc`` link ``target`` is a terminal."""
    return target.startswith(_TERMINALS)


def launcher_streams(proc: Path = Path("/proc"), pid: int | None = None) -> tuple[str, str] | None:
    """Where the parent's stdout and stderr lead, if the parent is a launcher on this host.

    Args:
        proc: The proc file system (a test's stand-in).
        pid: The parent's process id (default: this process's parent).

    Returns:
        The two ``/proc/PID/fd`` link targets, or ``None`` when the parent is no launcher
        (a remote rank's daemon) or cannot be read (another OS, another user).
    """
    pid = os.getppid() if pid is None else pid
    try:
        name = (proc / str(pid) / "comm").read_text().strip()
        if name not in LAUNCHERS:
            return None
        out, err = (os.readlink(proc / str(pid) / "fd" / str(fd)) for fd in (1, 2))
    except OSError:
        return None
    return out, err


def reaches_terminal(environ: Mapping[str, str] | None = None,
                     proc: Path = Path("/proc")) -> bool:
    """Whether both the run's stdout and stderr reach a terminal (then, and only then, a bar).

    Both: a bar's carriage returns in ``2> err.log`` are as unreadable as in ``> log``, and a
    log on stdout wants the plain lines a bar would replace.

    Args:
        environ: The environment (default ``os.environ``).
        proc: The proc file system (a test's stand-in).
    """
    if not under_launcher(environ):
        return sys.stdout.isatty() and sys.stderr.isatty()
    streams = launcher_streams(proc)
    # A rank that cannot see its launcher's console writes lines: readable anywhere.
    return streams is not None and all(leads_to_terminal(s) for s in streams)
