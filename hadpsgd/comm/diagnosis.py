"""Who is missing past a deadline: the notes stuck ranks send each other, and the answers.

When a wait passes its deadline the rank tells every peer "I am stuck in operation #seq" on
the watchdog's control communicator and waits a short grace period: a peer stuck with it
sends the same note, a live one busy elsewhere answers what it is doing (its watchdog's
monitor thread does, :mod:`hadpsgd.comm.deadline`), and whoever does neither is named as
the peer that never arrived (and, under ``--on-failure continue``, killed as frozen).
:class:`Diagnosis` is that part of :class:`hadpsgd.comm.deadline.Watchdog`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hadpsgd.comm.timeouts import (
    CommTimeoutError,
    note_killed,
    silent_handler,
    stalled_for,
)

_DIAG_TAG = 7_771
"""Tag of the "I am stuck in operation #seq" messages on the control communicator."""
_REPLY_TAG = 7_772
"""Tag of the answers "I am alive, doing <activity>" to a stuck peer's note."""
_REPLY_BYTES = 160
_END_TAG = 7_773
"""Tag of the note "I have ended my script, with this exit code" (:meth:`Watchdog.announce_end`)."""


class Diagnosis:
    """The diagnosis half of a watchdog: it names the missing peers when a wait times out.

    A mixin of :class:`hadpsgd.comm.deadline.Watchdog`, which holds the state it reads (the
    attributes below) and answers the notes from its monitor thread.
    """

    control: Any
    timeout: float
    setting: str
    seq: int
    phase: str
    answer: bool
    parent: Diagnosis | None
    _any: int
    _lock: threading.Lock
    _noted: dict[int, float]
    _sending: list[tuple[Any, Any]]
    _replies: dict[int, tuple[float, str]]
    ended: dict[int, int]

    def _answering(self) -> Diagnosis | None:
        """The watchdog whose monitor answers peers' notes for this one.

        Itself, its parent (a channel's), or None (no monitor: only the deadline tells).
        """
        if self.answer:
            return self
        return self.parent if self.parent is not None and self.parent.answer else None

    def _where(self) -> str:
        """``rank R``, with the start-up phase when in one (the head of a deadline's error)."""
        where = f"rank {self.control.Get_rank()}"
        return f"{where} (start-up: {self.phase})" if self.phase else where

    def fail(self, what: str, group: list[int] | None = None,
             stalled: float | None = None) -> None:
        """Find out which peers are not stuck with us and raise the error.

        Every rank that times out tells every other rank so, whatever the group of the
        operation: in a hierarchical collective a rank may be blocked by a peer of a peer
        (the inter-node partner waits on its own node), and only the whole picture names the
        rank that really is missing. A missing peer that answers says what it is doing.

        Args:
            what: The operation, for the message.
            group: World ranks taking part (default: everyone).
            stalled: Seconds this process was not running during the wait, as the caller
                measured it (default: this thread's last :func:`poll`).
        """
        me = self.control.Get_rank()
        everyone = [r for r in range(self.control.Get_size()) if r != me]
        missing, replies = self._diagnose(everyone)
        # A peer that answers from inside this very call arrived: its own deadline has not
        # passed yet (it entered later, e.g. descheduled on a busy host), so it sent no note
        # in our grace period. Naming it as missing would blame a bystander.
        same_call = f"waiting in {what} (operation #{self.seq})"
        missing = [r for r in missing if not replies.get(r, "").endswith(same_call)]
        if group is not None:
            # Prefer the culprits among this operation's own peers when they are among them.
            in_group = [r for r in missing if r in group]
            missing = in_group or missing
        killed = False
        answering = self._answering()
        if missing and answering is not None and answering is not self:
            # This channel's peers do not answer here (no monitor on its control): ask on the
            # main one, where every live learner's watchdog answers.
            replies.update(answering.probe([r for r in missing if r not in replies]))
        if missing:
            told = [f"rank {r} answers: {replies[r]}" for r in missing if r in replies]
            silent = [r for r in missing if r not in replies]
            who = f"rank(s) {', '.join(map(str, missing))} never arrived"
            if told:
                who += " (" + "; ".join(told) + ")"
            if silent and answering is not None:
                who += (f" (rank(s) {', '.join(map(str, silent))} did not answer: dead or "
                        "frozen)")
                # Start-up has no run to go on with: a frozen learner ends the job there, also
                # under --on-failure continue (the survivors rebuild from a trained snapshot).
                handler = silent_handler() if not self.phase else None
                killed = bool(handler is not None and handler(silent))
                if killed:
                    note_killed(silent)
                    who += "; killed by a learner on its host, so that the others go on"
        elif (stalled := max(stalled or 0.0, stalled_for())) > max(1.0, self.timeout / 4):
            # Frozen past the deadline and then let go (the launcher's SIGCONT before its
            # SIGTERM): the peers timed out waiting for this rank and named it first.
            who = (f"this rank was itself stopped for {stalled:.0f} s during the wait "
                   "(SIGSTOP, a debugger, swapping), so its peers timed out waiting for it and "
                   "named it; their messages are the diagnosis")
        else:
            who = "every peer is waiting too (a mismatched call order?)"
        raise CommTimeoutError(
            f"{self._where()}: {what} (operation #{self.seq}) did not complete within "
            f"{self.timeout:g} s ({self.setting}): {who}. A peer is dead, stuck or took "
            f"another code path; see its log. Raise {self.setting} if peers are merely slow.",
            missing=missing, peer_killed=killed,
        )

    def _diagnose(self, peers: list[int]) -> tuple[list[int], dict[int, str]]:
        """Returns the peers that are not stuck with us, and what the answering ones said."""
        import numpy as np

        note = np.array([self.seq], dtype=np.int64)
        start = time.monotonic()
        for p in peers:  # fire and forget: a dead peer must not block us
            self.control.Isend(note, dest=p, tag=_DIAG_TAG)
        heard: set[int] = set()
        replies: dict[int, str] = {}
        end = start + self._grace()
        buf = np.empty(1, dtype=np.int64)
        text = np.empty(_REPLY_BYTES, dtype=np.uint8)
        status = self._status()
        while time.monotonic() < end and len(heard | set(replies)) < len(peers):
            got = False
            with self._lock:
                # Notes the answering thread took off the wire while we were stuck count too.
                heard.update(p for p, t in self._noted.items() if t >= start - self.timeout)
                if (msg := self.control.Improbe(source=self._any, tag=_DIAG_TAG, status=status)):
                    msg.Recv(buf)
                    heard.add(status.Get_source())
                    got = True
                if self.answer:
                    got = self._take_replies(text, status) or got
                replies.update(self._replies_since(start))
            if not got:
                time.sleep(1e-3)
        return [p for p in peers if p not in heard], replies

    def probe(self, peers: list[int]) -> dict[int, str]:
        """Ask ``peers`` whether they are alive; returns what the answering ones are doing.

        For a channel's watchdog (:attr:`parent`): it sends the same note as a stuck rank
        does, on this (the answering) watchdog's control communicator, and waits the same
        grace for the answers. It takes no peer's note off the wire (those are the monitor
        thread's to answer), and the answers go through one record, so that a diagnosis of
        this watchdog's own running at the same time loses none of them.
        """
        import numpy as np

        if not peers:
            return {}
        note = np.array([self.seq], dtype=np.int64)
        start = time.monotonic()
        with self._lock:
            for p in peers:
                self._sending.append((self.control.Isend(note, dest=p, tag=_DIAG_TAG), note))
        end = start + self._grace()
        text = np.empty(_REPLY_BYTES, dtype=np.uint8)
        status = self._status()
        replies: dict[int, str] = {}
        while time.monotonic() < end and len(replies) < len(peers):
            with self._lock:
                got = self._take_replies(text, status)
                replies = {p: r for p, r in self._replies_since(start).items() if p in peers}
            if not got:
                time.sleep(1e-3)
        return replies

    def _grace(self) -> float:
        """How long a diagnosis waits for the peers' notes and answers."""
        return min(5.0, max(1.0, self.timeout / 2))

    def _take_replies(self, text: Any, status: Any) -> bool:
        """Take every answer on the wire into the shared record (the caller holds the lock)."""
        got = False
        while (msg := self.control.Improbe(source=self._any, tag=_REPLY_TAG, status=status)):
            msg.Recv(text)
            self._replies[status.Get_source()] = (
                time.monotonic(), bytes(text).rstrip(b"\0").decode(errors="replace"))
            got = True
        return got

    def _replies_since(self, start: float) -> dict[int, str]:
        """The answers that arrived after ``start`` (a note sent then), by peer."""
        return {p: said for p, (when, said) in self._replies.items() if when >= start}

    def _status(self) -> Any:
        from mpi4py import MPI

        return MPI.Status()


__all__ = ["Diagnosis"]
