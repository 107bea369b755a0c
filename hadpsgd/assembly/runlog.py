"""``RUN_DIR/train.log``: rank 0's console, kept beside the run's other files.

Every line rank 0 writes to stdout or stderr (the ``[hadpsgd]`` lines, the training log
lines, warnings, the summary, an error and its traceback) also goes to ``train.log`` in the
run directory, one whole line at a time, flushed as it is written: a run that dies keeps
every line it printed. A tee, not the ``logging`` module: the lines are ``print`` calls all
over the package and the terminal must keep getting them as before.

The tee is installed before the run directory is known (the lines of its making are kept in
memory) and attached to the file once the directory stands, so a start refused before that
writes nothing there. Every start appends a separator line naming what it is: a fresh start,
a resume (with ``--resume``'s argument) or a learner taking over as rank 0 after a failure.
A progress bar's carriage-return frames are reduced to the last one, as a terminal shows it.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

LOG_FILE = "train.log"
"""The log's name in the run directory."""
EARLY_LINES = 1000
"""Lines kept in memory before the run directory stands (the rest of a flood is dropped)."""
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a bar's cursor moves and colours


class _Tee:
    """A text stream that writes through to ``stream`` and hands whole lines to ``log``."""

    def __init__(self, stream: TextIO, log: ConsoleLog) -> None:
        self._stream = stream
        self._log = log
        self._partial = ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._log.take(self, text)
        return written

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def __getattr__(self, name: str) -> Any:
        # fileno, encoding, buffer, ...: what tqdm, faulthandler and others ask of a stream.
        return getattr(self._stream, name)


class ConsoleLog:
    """Rank 0's stdout and stderr, also appended to ``RUN_DIR/train.log``.

    Use :meth:`install` (replaces ``sys.stdout``/``sys.stderr`` with tees), :meth:`attach`
    once the run directory is made, and :meth:`close` at the end (puts the streams back).
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self._fh: TextIO | None = None
        self._early: list[str] = []
        # Re-entrant: a signal handler that prints while this thread holds it must not hang.
        self._lock = threading.RLock()
        self._saved: tuple[TextIO, TextIO] | None = None
        self._tees: tuple[_Tee, _Tee] | None = None

    @property
    def installed(self) -> bool:
        """Whether this process's streams are teed."""
        return self._saved is not None

    def install(self) -> None:
        """Tee ``sys.stdout`` and ``sys.stderr`` (lines are kept until :meth:`attach`)."""
        if self._saved is not None:
            return
        self._saved = (sys.stdout, sys.stderr)
        self._tees = (_Tee(sys.stdout, self), _Tee(sys.stderr, self))
        sys.stdout, sys.stderr = self._tees

    def attach(self, run_dir: Path, what: str) -> Path:
        """Append to ``run_dir/train.log`` from now on, after a separator naming ``what``.

        Args:
            run_dir: The run directory (it exists).
            what: What this start is, e.g. ``"start"``, ``"resume (--resume auto)"``.

        Returns:
            The log's path.
        """
        path = Path(run_dir) / LOG_FILE
        with self._lock:
            if self._fh is not None:
                self._fh.close()
            # Line-buffered, and flushed after every line besides: a crash loses no line.
            self._fh = path.open("a", encoding="utf-8", buffering=1)
            self.path = path
            command = " ".join(["hadpsgd.run", *sys.argv[1:]])
            self._write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {command} =====")
            for line in self._early:
                self._write(line)
            self._early.clear()
        return path

    def take(self, tee: _Tee, text: str) -> None:
        """Collect ``text`` written to ``tee``; its whole lines go to the log."""
        with self._lock:
            buffered = tee._partial + text
            lines = buffered.split("\n")
            tee._partial = lines.pop()
            if "\r" in tee._partial:  # a bar redrawn in place: only its last frame counts
                tee._partial = tee._partial.rsplit("\r", 1)[1]
            for line in lines:
                line = _ESCAPES.sub("", line.rsplit("\r", 1)[-1])
                if self._fh is not None:
                    self._write(line)
                elif len(self._early) < EARLY_LINES:
                    self._early.append(line)

    def _write(self, line: str) -> None:
        assert self._fh is not None
        try:
            self._fh.write(line + "\n")
            self._fh.flush()
        except (OSError, ValueError):
            # A full disk must not end the run over its log: the console still has the line.
            pass

    def close(self) -> None:
        """Write what is left of a line, close the file and put the streams back."""
        with self._lock:
            for tee in self._tees or ():
                if tee._partial and self._fh is not None:
                    self._write(_ESCAPES.sub("", tee._partial))
                tee._partial = ""
            if self._fh is not None:
                self._fh.close()
                self._fh = None
        if self._saved is not None and self._tees is not None:
            # Only where nobody replaced them since (a test's capture, say).
            if sys.stdout is self._tees[0]:
                sys.stdout = self._saved[0]
            if sys.stderr is self._tees[1]:
                sys.stderr = self._saved[1]
        self._saved, self._tees = None, None
        self._early.clear()


CONSOLE = ConsoleLog()
"""This process's console log (installed by ``hadpsgd.run`` on rank 0)."""

__all__ = ["CONSOLE", "LOG_FILE", "ConsoleLog"]
