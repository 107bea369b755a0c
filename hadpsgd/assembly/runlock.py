"""One live run per run directory: a lock held for the life of the run.

Two runs started in one ``--out-dir`` at once both pass the "is a run there?" check, then
prune each other's checkpoints and overwrite each other's ``config.json``. So rank 0 holds an
exclusive ``flock(2)`` on ``RUN_DIR/.hadpsgd.lock`` from before anything is written until the
process ends, and writes its host, pid and start time into it; a second run that cannot take
the lock is refused, naming the first.

A lock of a run that died is not stale in the way a pid file is: the kernel (or the file
server) drops a ``flock`` when its holder's process ends, however it ends, so the next run
simply takes it over; the file itself is never deleted (deleting a lock file races with a
run opening it).

What this relies on: ``flock`` on the file system of ``--out-dir``. Local file systems have
it; on NFS (v4, or v3 with a lock manager) Linux maps it onto the server's byte-range locks,
so it holds across hosts; Lustre needs the ``flock`` mount option, GPFS and BeeGFS have it.
Where the file system refuses locks (``ENOLCK``, ``EOPNOTSUPP``), the run goes on with a
note that one-run-per-directory is not enforced there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".hadpsgd.lock"
"""The lock file in a run directory (kept; never deleted)."""

_held: dict[str, int] = {}
"""This process's locks: resolved run directory -> the open descriptor that holds it."""


def _holder(fd: int) -> str:
    """Who holds the lock, from its file's content, in words."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        return (f"pid {info['pid']} on host {info['host']}, started {info['started']}"
                + (f" ({info['command']})" if info.get("command") else ""))
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file does not say which)"


def lock_run(out: Path, command: str = "") -> str | None:
    """Take the run directory ``out``'s lock for this process (idempotent).

    Args:
        out: The run directory; it must exist.
        command: What this run is, for the message a second run gets (e.g. the argv).

    Returns:
        None when held; a note when the file system has no locks (the run may go on).

    Raises:
        RunDirBusy: If another live run holds it, naming that run (host, pid, start time).
        RunDirUnwritable: If its lock file cannot be opened for writing (a read-only
            directory or file system, another user's lock file), naming it and the fix.
    """
    key = str(Path(out).resolve())
    if key in _held:
        return None
    path = Path(out) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:  # the user's directory, not a bug: no traceback
        raise RunDirUnwritable(
            f"--out-dir {out} is not writable: its lock file {path} cannot be opened for "
            f"writing ({err.strerror or err}); make the directory (and {LOCK_FILE}, if "
            "another user left it) writable for this user, or use another --out-dir "
            "(a resume copies the run there first)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = _holder(fd)
            os.close(fd)
            raise RunDirBusy(f"--out-dir {out} is in use by another run: {who} (it holds "
                             f"{path}); wait for it to end, or use another --out-dir") from None
        os.close(fd)
        return (f"the file system of --out-dir {out} does not support file locks "
                f"({err.strerror or err}): a second run started there at the same time would "
                "not be refused")
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held[key] = fd
    return None


def release_runs() -> None:
    """Drop this process's run-directory locks (the end of a run; process exit does too)."""
    while _held:
        _, fd = _held.popitem()
        try:
            os.ftruncate(fd, 0)  # a later reader finds no stale holder's name
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


class RunDirBusy(ValueError):
    """Another live run holds the run directory; the message names it and the way on."""


class RunDirUnwritable(ValueError):
    """The run directory's lock file cannot be written; the message names it and the way on."""
