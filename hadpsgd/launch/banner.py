"""Drop Open MPI's ``Process name … Exit code: 2`` banner from ``mpirun``'s stderr.

A user error (a mistyped flag, a bad option of ``hadpsgd.Distributed``) is said once by
rank 0 and every rank exits 2 (:data:`hadpsgd.exit_codes.EXIT_USER_ERROR`). Open MPI's
``mpirun`` (PRRTE) then adds a six-line banner naming one rank and its exit code 2, which
says nothing the error did not. PRRTE has no switch for that banner alone: the one that
silences it (``--mca state_base_error_non_zero_exit 0``) also makes ``mpirun`` exit 0 when
every rank exits 2 (measured with Open MPI 5.0), and the exit code is the contract scripts
read. So the launcher keeps that code and drops the banner as it copies ``mpirun``'s
stderr; a banner for any other code, and everything else, passes unchanged and at once.
"""

from __future__ import annotations

import re
import threading
from typing import BinaryIO

from hadpsgd.exit_codes import EXIT_USER_ERROR

_RULE = re.compile(rb"-{20,}\s*")
_PIECES = re.compile(rb"[^\n]*\n|[^\n]+")
_NON_ZERO = b"exited with non-zero status"
_CODE = re.compile(rb"Exit code:\s+(\d+)")
_MAX_LINES = 12
"""A held block longer than this is no banner: it is let through."""
TAIL_BYTES = 16384
"""How much of the end of ``mpirun``'s stderr :func:`copy_filtered` keeps when asked."""


class BannerFilter:
    """Copies bytes through, holding back only a possible banner until it is known.

    A banner is a block between two rules (lines of dashes): the opening rule is held, and
    the block is passed on as soon as its first line is not the non-zero-exit banner's.
    Bytes of any other line (a progress bar without a newline too) pass at once.
    """

    def __init__(self, dropped_code: int = EXIT_USER_ERROR) -> None:
        self._dropped = dropped_code
        self._held: list[bytes] = []  # complete lines of a possible banner, from its rule
        self._line = b""  # the start of the current line, when it may be a rule
        self._passing = False  # the current line is not at its start and was let through

    def feed(self, data: bytes) -> bytes:
        """Take ``data`` read from the pipe; return what may be written now."""
        out = bytearray()
        for piece in _PIECES.findall(data):  # not splitlines: a progress bar's \r is no end
            if self._passing:
                out += piece
                self._passing = not piece.endswith(b"\n")
                continue
            line = self._line + piece
            if not line.endswith(b"\n"):
                if self._held or line.startswith(b"-"):
                    self._line = line  # a rule or a banner's line, still arriving
                else:
                    out += line
                    self._line, self._passing = b"", True
                continue
            self._line = b""
            out += self._complete(line)
        return bytes(out)

    def flush(self) -> bytes:
        """What is still held at the end of the stream (a block that never closed)."""
        rest = b"".join(self._held) + self._line
        self._held, self._line = [], b""
        return rest

    def _complete(self, line: bytes) -> bytes:
        """One whole line: held, dropped with its block, or returned with what was held."""
        is_rule = bool(_RULE.fullmatch(line))
        if not self._held:
            if is_rule:
                self._held = [line]
                return b""
            return line
        if is_rule and len(self._held) == 1:
            # Two rules in a row: the first closed an earlier block; the new one is held.
            earlier, self._held = self._held[0], [line]
            return earlier
        self._held.append(line)
        if len(self._held) == 2 and _NON_ZERO not in line:
            return self.flush()  # another message between rules: not ours to drop
        if is_rule:
            block = b"".join(self._held)
            self._held = []
            code = _CODE.search(block)
            if code and int(code.group(1)) == self._dropped:
                return b""
            return block
        if len(self._held) > _MAX_LINES:
            return self.flush()
        return b""


def copy_filtered(source: BinaryIO, sink: BinaryIO,
                  tail: bytearray | None = None) -> threading.Thread:
    """Copy ``source`` to ``sink`` through a :class:`BannerFilter` in a daemon thread.

    Args:
        source: The pipe to read (``mpirun``'s stderr).
        sink: Where the filtered bytes go.
        tail: If given, the last :data:`TAIL_BYTES` read are kept in it (unfiltered), for
            the caller to read the launcher's own last words once the thread has ended.

    Returns:
        The started thread; join it once the process that writes ``source`` has ended.
    """

    def pump() -> None:
        banner = BannerFilter()
        while True:
            data = source.read1(65536) if hasattr(source, "read1") else source.read(65536)
            if not data:
                break
            if tail is not None:
                tail.extend(data)
                del tail[:-TAIL_BYTES]
            _write(sink, banner.feed(data))
        _write(sink, banner.flush())

    thread = threading.Thread(target=pump, name="hadpsgd-launch-stderr", daemon=True)
    thread.start()
    return thread


def _write(sink: BinaryIO, data: bytes) -> None:
    if data:
        sink.write(data)
        sink.flush()
