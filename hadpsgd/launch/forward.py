"""Run the launcher and turn SIGTERM/SIGINT into the graceful-stop signal the ranks understand.

Open MPI's ``mpirun`` answers SIGTERM or SIGINT by killing the ranks about a quarter of a
second later, too soon for a checkpoint; it forwards SIGUSR1 untouched. So the local launcher
catches SIGTERM and SIGINT (Ctrl-C) and sends SIGUSR1 to ``mpirun`` instead: every rank then
checkpoints at its next control point and exits 75. A second SIGTERM/SIGINT is passed on as
it is, for a user who does not want to wait.

``mpirun``'s stderr (its own messages and the ranks') is copied through
:mod:`hadpsgd.launch.banner`, which drops only Open MPI's banner after a user error (exit 2).

Under ``--with-ft ulfm`` every rank notes its own exit in a folder of the launcher's
(:func:`hadpsgd.comm.ulfm.note_exit`). Once every rank has (all of them ended), ``mpirun``
has nothing left to wait for, but Open MPI's runtime can still hang after a job's end
(openpmix/prrte#1839; a CI run here: every rank of a 4-rank job ended on its own error, and
the launch was still there 240 s later). So the launcher gives it
:data:`AFTER_LAST_EXIT_S` seconds, then ends it itself and returns the code the ranks noted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from hadpsgd.launch.banner import copy_filtered
from hadpsgd.launch.mpirun import LAUNCH_TRIES, launcher_failed_to_start

GRACEFUL = signal.SIGUSR1

AFTER_LAST_EXIT_S = 10.0
"""Seconds ``mpirun`` may take to end once every rank has noted its own exit: its own
cleanup takes well under one; past this it is taken for hung and ended."""


def run_forwarding(cmd: Sequence[str], env: dict[str, str], exits: Path | None = None,
                   nprocs: int = 0, after_last_exit_s: float = AFTER_LAST_EXIT_S) -> int:
    """Run ``cmd`` (an ``mpirun`` command line) to completion, forwarding stop signals.

    Where Open MPI's launcher fails to start before any rank exists (its PMIx listener,
    exit 213), nothing of the job ran and it is started again, up to
    :data:`~hadpsgd.launch.mpirun.LAUNCH_TRIES` times in all, saying so.

    Args:
        cmd: The ``mpirun`` command line.
        env: Its environment.
        exits: The folder where each of the ``nprocs`` ranks notes its own exit (``--with-ft
            ulfm``), or None: ``mpirun`` still there ``after_last_exit_s`` seconds after the
            last note is ended, and the ranks' code returned.
        nprocs: Ranks of the job (their notes are awaited; 0: none).
        after_last_exit_s: See :data:`AFTER_LAST_EXIT_S`.

    Returns:
        Its exit code (128 + n if it was killed by signal n, as a shell reports it).
    """
    watch = (exits, nprocs, after_last_exit_s) if exits is not None and nprocs > 0 else None
    for attempt in range(1, LAUNCH_TRIES):
        code, tail, stopped = _run_once(cmd, env, watch)
        if code == 0 or stopped or not launcher_failed_to_start(tail.decode(errors="replace")):
            return code
        print(f"[hadpsgd.launch] mpirun failed to start before any rank ran (exit {code}): "
              f"starting it again ({attempt + 1} of {LAUNCH_TRIES})", file=sys.stderr,
              flush=True)
    return _run_once(cmd, env, watch)[0]  # the last launch: its code, whatever it is


def noted_exits(exits: Path) -> list[int]:
    """The exit codes the ranks noted in ``exits`` (one file a process; unreadable: 1)."""
    codes = []
    for note in sorted(exits.glob("pid-*")):
        try:
            codes.append(int(note.read_text().strip() or "1"))
        except (OSError, ValueError):
            codes.append(1)
    return codes


def _run_once(cmd: Sequence[str], env: dict[str, str],
              watch: tuple[Path, int, float] | None = None) -> tuple[int, bytes, bool]:
    """One launch: ``(exit code, the end of its stderr, whether a stop was asked)``.

    A launch is only repeated where no rank ran, so no earlier launch left notes in
    ``watch``'s folder.
    """
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
        code = _wait(proc, watch)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # mpirun has ended; its stderr ends when the last rank it left behind closes it too.
    if copier is not None:
        copier.join(timeout=10)
    return (128 - code if code < 0 else code), bytes(tail), asked > 0


def _wait(proc: subprocess.Popen, watch: tuple[Path, int, float] | None) -> int:
    """``proc``'s exit status; with ``watch``, ended where it outlives every rank's note."""
    if watch is None:
        return proc.wait()
    exits, nprocs, grace = watch
    all_ended = None  # when the last rank's note was first seen
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if all_ended is None:
            if len(list(exits.glob("pid-*"))) >= nprocs:
                all_ended = time.monotonic()
            continue
        if time.monotonic() - all_ended < grace:
            continue
        codes = noted_exits(exits)
        code = next((c for c in codes if c != 0), 0)
        print(f"[hadpsgd.launch] every one of the {nprocs} ranks ended (exit "
              f"{', '.join(map(str, sorted(set(codes))))}), but mpirun was still there "
              f"{grace:g} s later (Open MPI's runtime hanging after the job's end): ended "
              f"by the launcher; exit {code}, the ranks' own", file=sys.stderr, flush=True)
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return code
