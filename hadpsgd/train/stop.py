"""Graceful stop on SIGTERM / SIGINT / SIGUSR1: checkpoint at the next agreed step, exit 75.

The handler only records the request; the training loop polls it and all ranks agree on it at
their next control point (a small allreduce every ``--control-every`` steps), so every rank
stops after the same step and writes one consistent checkpoint. A second SIGINT or SIGTERM on
the same rank gives up on the graceful path and ends the process at once.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""SIGUSR1 is what Slurm's ``--signal`` and ``python -m hadpsgd.launch`` send: Open MPI's
``mpirun`` forwards it to every rank without killing them, unlike SIGTERM/SIGINT, after which
it kills the ranks within about a quarter of a second."""


class StopFlag:
    """Records the first stop signal this process receives."""

    def __init__(self) -> None:
        self.signame: str | None = None
        self._previous: dict[int, object] = {}

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
        """Restore the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum != signal.SIGUSR1:
            # Asked twice: the user does not want to wait for the checkpoint.
            print(f"hadpsgd: {name} again: stopping now without a checkpoint", file=sys.stderr,
                  flush=True)
            raise KeyboardInterrupt
        self.request(name)
        print(f"[hadpsgd] {name} received: will checkpoint and stop at the next control point "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)


FLAG = StopFlag()
"""The process-wide flag (signal handlers are process-wide too)."""
