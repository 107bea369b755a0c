"""Run the launcher and turn SIGTERM/SIGINT into the graceful-stop signal the ranks understand.

Open MPI's ``mpirun`` answers SIGTERM or SIGINT by killing the ranks about a quarter of a
second later, too soon for a checkpoint; it forwards SIGUSR1 untouched. So the local launcher
catches SIGTERM and SIGINT (Ctrl-C) and sends SIGUSR1 to ``mpirun`` instead: every rank then
checkpoints at its next control point and exits 75. A second SIGTERM/SIGINT is passed on as
it is, for a user who does not want to wait.

``mpirun``'s stderr (its own messages and the ranks') is copied through
:mod:`hadpsgd.launch.banner`, which drops only Open MPI's banner after a user error (exit 2).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

from hadpsgd.launch.banner import copy_filtered
from hadpsgd.launch.mpirun import LAUNCH_TRIES, launcher_failed_to_start

GRACEFUL = signal.SIGUSR1


def run_forwarding(cmd: Sequence[str], env: dict[str, str]) -> int:
    """Run ``cmd`` (an ``mpirun`` command line) to completion, forwarding stop signals.

    Where Open MPI's launcher fails to start before any rank exists (its PMIx listener,
    exit 213), nothing of the job ran and it is started again, up to
    :data:`~hadpsgd.launch.mpirun.LAUNCH_TRIES` times in all, saying so.

    Returns:
        Its exit code (128 + n if it was killed by signal n, as a shell reports it).
    """
    for attempt in range(1, LAUNCH_TRIES):
        code, tail, stopped = _run_once(cmd, env)
        if code == 0 or stopped or not launcher_failed_to_start(tail.decode(errors="replace")):
            return code
        print(f"[hadpsgd.launch] mpirun failed to start before any rank ran (exit {code}): "
              f"starting it again ({attempt + 1} of {LAUNCH_TRIES})", file=sys.stderr,
              flush=True)
    return _run_once(cmd, env)[0]  # the last launch: its code, whatever it is


def _run_once(cmd: Sequence[str], env: dict[str, str]) -> tuple[int, bytes, bool]:
    """One launch: ``(exit code, the end of its stderr, whether a stop was asked)``."""
    sink = getattr(sys.stderr, "buffer", None)  # None: a caller replaced sys.stderr
    proc = subprocess.Popen(list(cmd), env=env,
                            stderr=subprocess.PIPE if sink is not None else None)
    tail = bytearray()
    copier = copy_filtered(proc.stderr, sink, tail) if proc.stderr and sink else None
    asked = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal asked
        asked += 1
        if asked == 1:
            print(f"[hadpsgd.launch] {signal.Signals(signum).name}: asking every rank to "
                  "checkpoint and stop (again to stop at once)", file=sys.stderr, flush=True)
            proc.send_signal(GRACEFUL)
        else:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries, but be safe
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # mpirun has ended; its stderr ends when the last rank it left behind closes it too.
    if copier is not None:
        copier.join(timeout=10)
    return (128 - code if code < 0 else code), bytes(tail), asked > 0
