"""Graceful stop on SIGTERM / SIGINT / SIGUSR1: checkpoint at the next agreed step, exit 75.

The handler only records the request; the training loop polls it and all ranks agree on it at
their next control point (a small allreduce every ``--control-every`` steps), so every rank
stops after the same step and writes one consistent checkpoint. A second SIGINT or SIGTERM on
the same rank gives up on the graceful path and ends the process at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""SIGUSR1 is what Slurm's ``--signal`` and ``python -m hadpsgd.launch`` send: Open MPI's
``mpirun`` forwards it to every rank without killing them, unlike SIGTERM/SIGINT, after which
it kills the ranks within about a quarter of a second."""


ACK_DELAY_S = 1.0
"""How long after a stop signal its line is said. Open MPI's launcher sends SIGTERM to every
rank when it ends the job (a rank's abort, a SIGTERM or Ctrl-C to ``mpirun``) and SIGKILL
about 0.25 s later (measured): a rank still there after this delay was asked to stop, not
being ended, and may promise a checkpoint."""


class StopFlag:
    """Records the first stop signal this process receives."""

    def __init__(self) -> None:
        self.signame: str | None = None
        self._previous: dict[int, object] = {}
        self._ending = False
        self._ack: threading.Timer | None = None
        self._said = False  # the stop's line was printed

    def ending(self) -> None:
        """This process is ending on a failure: a stop signal from now on says nothing.

        It is the launcher ending the job after an abort (or a user's Ctrl-C on top of
        one); promising a checkpoint then would be untrue.
        """
        self._ending = True
        if self._ack is not None:
            self._ack.cancel()

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signame is not None

    def request(self, why: str) -> None:
        """Ask for a stop (what the signal handler does; tests may call it directly)."""
        if self.signame is None:
            self.signame = why

    def install(self) -> None:
        """Install the handlers (main thread only, as Python requires)."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`.

        A stop's line not said yet is said now: the run honoured it (it stopped at its
        control point, or ended first) sooner than the line's delay.
        """
        if self._ack is not None:
            self._ack.cancel()
            if self.signame is not None:
                self._acknowledge(self.signame)  # nothing if said, or if failing
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._ending:
            return  # the launcher ends the job after this rank's failure: it exits anyway
        if self.requested and signum != signal.SIGUSR1:
            # Asked twice: the user does not want to wait for the checkpoint.
            print(f"hadpsgd: {name} again: stopping now without a checkpoint", file=sys.stderr,
                  flush=True)
            raise KeyboardInterrupt
        self.request(name)
        # Said a moment later, and only if this rank is still there and not failing: a
        # SIGTERM is also how the launcher ends every rank after another one's abort.
        self._ack = threading.Timer(ACK_DELAY_S, self._acknowledge, args=(name,))
        self._ack.daemon = True
        self._ack.start()

    def _acknowledge(self, name: str) -> None:
        if self._ending or self._said:
            return
        self._said = True
        print(f"[hadpsgd] {name} received: stopping with a checkpoint at the next control "
              "point (send it again to stop at once)", file=sys.stderr, flush=True)


FLAG = StopFlag()
"""The process-wide flag (signal handlers are process-wide too)."""
