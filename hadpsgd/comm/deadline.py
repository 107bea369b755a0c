"""Deadlines on every blocking wait, so that a dead or missing peer becomes an error, not a hang.

When a collective times out, the ranks that are stuck in it tell each other so over a separate
control communicator; whoever does not answer within a short grace period is named in the
error as the peer that never arrived.

This module is the :class:`Watchdog`: deadlines on blocking calls (a monitor thread) and on
non-blocking waits (:func:`poll`), the answers to peers' notes, the notes of a script's end.
Naming the missing peers is :mod:`hadpsgd.comm.diagnosis`; the errors, :func:`poll` and the
last words before an abort are :mod:`hadpsgd.comm.timeouts`, whose names are re-exported here.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

from hadpsgd import env
from hadpsgd.comm.diagnosis import _DIAG_TAG, _END_TAG, _REPLY_BYTES, _REPLY_TAG, Diagnosis
from hadpsgd.comm.timeouts import (
    DEFAULT_TIMEOUT_S,
    CommTimeoutError,
    PeerEndedError,
    _say,
    before_abort,
    job_code,
    killed_peers,
    last_words,
    note_killed,
    on_silent_peers,
    poll,
    stalled_for,
    timeout_from_env,
)
from hadpsgd.exit_codes import EXIT_TIMED_OUT

_monotonic = time.monotonic


class Guard:
    """A blocking call under a :class:`Watchdog`'s deadline (see :meth:`Watchdog.guard`)."""

    __slots__ = ("_group", "_watchdog", "_what")

    def __init__(self, watchdog: Watchdog, what: str, group: list[int] | None) -> None:
        self._watchdog = watchdog
        self._what = what
        self._group = group

    def __enter__(self) -> None:
        self._watchdog.arm(self._what, self._group)

    def __exit__(self, *exc: object) -> None:
        self._watchdog._active = None


class Watchdog(Diagnosis):
    """Waits on MPI requests with a deadline and names the missing peers on a timeout.

    With ``answer=True`` (the main watchdog of a process, under THREAD_MULTIPLE) the monitor
    thread also answers other ranks' diagnosis notes with :attr:`activity`, so that a peer
    which is alive but stuck outside communication (a hang in user code, a slow data read)
    is reported with what it is doing, and one that does not answer as dead or frozen.

    Args:
        control: A communicator duplicated from the world, used only for diagnosis.
        timeout: Deadline in seconds.
        thread_multiple: Whether MPI granted THREAD_MULTIPLE: only then may the monitor
            thread of :meth:`guard` talk to the peers while the main thread is blocked.
        answer: Answer peers' diagnosis notes from the monitor thread (one watchdog per
            control communicator may do so).
    """

    def __init__(self, control: Any, timeout: float, thread_multiple: bool = True,
                 answer: bool = False, setting: str = env.TIMEOUT) -> None:
        self.control = control
        self.timeout = timeout
        self.setting = setting
        """The variable ``timeout`` came from, named when it passes (the start-up's first
        contact takes ``HADPSGD_START_TIMEOUT`` where set: :func:`hadpsgd.comm.init`)."""
        self.thread_multiple = thread_multiple
        self.answer = answer and thread_multiple
        self.seq = 0
        """Operations waited on so far; peers compare it to spot who is behind."""
        self.activity = "starting up"
        """What this rank is doing outside guarded calls (set through ``Topology.doing`` or
        ``Topology.now_doing``); sent to a stuck peer that asks."""
        self.phase = ""
        """The start-up phase this rank is in (``Topology.startup``; "" once it trains):
        named in a deadline's error, since start-up has no step to tell where a rank was."""
        self._active: tuple[str, list[int] | None, float, int] | None = None
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._noted: dict[int, float] = {}  # peer -> when its "I am stuck" note arrived
        self._sending: list[tuple[Any, Any]] = []  # in-flight replies and their buffers
        self._stopped = False
        self._reprieve: dict[int, float] = {}  # blocked call -> until when a kill may end it
        self.parent: Watchdog | None = None
        """The process's main watchdog, which answers peers' notes, for a channel's own
        (:meth:`Topology.side_channel` and its kin): past a deadline it asks the peers that
        did not arrive whether they are alive (:meth:`probe`), so that a frozen one is found
        and killed there as on the main communicator."""
        self._replies: dict[int, tuple[float, str]] = {}  # peer -> when, its last answer
        self.ended: dict[int, int] = {}
        """Peers that have ended their script (:meth:`announce_end`), with their exit code: a
        wait they take part in can never complete, so it ends the job at once."""
        # MPI_ANY_SOURCE is -1 in Open MPI but -2 in MPICH (where -1 is MPI_PROC_NULL).
        self._any = _any_source()
        if self.answer:
            self._ensure_monitor()

    def stop(self) -> None:
        """Stop the monitor thread (before MPI is finalized: it must not call MPI after)."""
        self._stopped = True
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=2.0)

    def guard(self, what: str, group: list[int] | None = None) -> Guard:
        """Run a *blocking* MPI call under the deadline: ``with watchdog.guard(what): ...``.

        Blocking collectives use MPI's tuned algorithms and progress by themselves, which is
        much faster for large buffers than polling a non-blocking one; but they cannot be
        interrupted. So a monitor thread watches the call: past the deadline it names the
        missing peers (as :meth:`fail` does), prints the error and aborts the job.

        The guard is a small object, not a generator (it is entered around every small
        collective, where a few microseconds are the cost of the call); :meth:`arm` and
        :meth:`disarm` are the same two steps for a caller's own ``try``/``finally``.
        """
        return Guard(self, what, group)

    def arm(self, what: str, group: list[int] | None = None) -> None:
        """Start watching a blocking call (:meth:`guard`'s entry); :meth:`disarm` ends it."""
        self.seq = seq = self.seq + 1
        if self._monitor is None:
            self._ensure_monitor()
        self._active = (what, group, _monotonic() + self.timeout, seq)

    def disarm(self) -> None:
        """The watched call returned (or raised): stop watching it (:meth:`guard`'s exit)."""
        self._active = None

    def _ensure_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="hadpsgd-watchdog",
                                             daemon=True)
            self._monitor.start()
            # Exit handlers run last-registered first, so this one runs before mpi4py's
            # MPI_Finalize: the thread never touches MPI after it.
            atexit.register(self.stop)

    def doing(self) -> str:
        """This rank's current activity, as told to a peer that asks."""
        active = self._active
        if active is not None:
            return f"waiting in {active[0]} (operation #{active[3]})"
        return self.activity

    def _answer_notes(self) -> None:
        """Receive peers' "stuck" notes (remembered for :meth:`_diagnose`) and reply."""
        import numpy as np

        note = np.empty(1, dtype=np.int64)
        status = self._status()
        with self._lock:
            while (msg := self.control.Improbe(source=self._any, tag=_DIAG_TAG, status=status)):
                msg.Recv(note)
                peer = status.Get_source()
                self._noted[peer] = time.monotonic()
                text = f"alive, {self.doing()}".encode()[:_REPLY_BYTES]
                reply = np.zeros(_REPLY_BYTES, dtype=np.uint8)
                reply[:len(text)] = np.frombuffer(text, dtype=np.uint8)
                self._sending.append((self.control.Isend(reply, dest=peer, tag=_REPLY_TAG),
                                      reply))
            while (msg := self.control.Improbe(source=self._any, tag=_END_TAG, status=status)):
                msg.Recv(note)
                self.ended[status.Get_source()] = int(note[0])
            self._sending = [(r, b) for r, b in self._sending if not r.Test()]

    def announce_end(self, code: int) -> None:
        """Tell every peer that this rank has ended its script with exit ``code``.

        Fire and forget (the notes are small, sent eagerly); the sends are kept with the
        replies' and completed as those are. A peer blocked in a wait this rank takes part
        in then ends the job at once with ``code`` (:meth:`check_ended`), instead of
        waiting for its deadline and blaming this rank as dead or frozen.
        """
        import numpy as np

        note = np.array([code], dtype=np.int64)
        me = self.control.Get_rank()
        with self._lock:
            for peer in range(self.control.Get_size()):
                if peer != me:
                    self._sending.append((self.control.Isend(note, dest=peer, tag=_END_TAG),
                                          note))

    def take_notes(self) -> None:
        """Receive the peers' notes now, from the calling thread (where no monitor runs)."""
        self._answer_notes()

    def finish_notes(self) -> bool:
        """Whether every note this rank sent (replies, ends) has left (then MPI may end)."""
        with self._lock:
            self._sending = [(r, b) for r, b in self._sending if not r.Test()]
            return not self._sending

    def _ended(self) -> dict[int, int]:
        """The peers that ended their script, as this process's answering watchdog heard."""
        answering = self._answering()
        return answering.ended if answering is not None else self.ended

    def check_ended(self, what: str, group: list[int] | None, seq: int | None = None) -> None:
        """Raise :class:`PeerEndedError` if a peer of ``group`` has ended its script.

        Args:
            what: The operation waited on, for the message.
            group: World ranks taking part (None: everyone).
            seq: The operation's number (default: the last one).
        """
        ended = self._ended()
        if not ended:
            return
        gone = {r: c for r, c in ended.items() if group is None or r in group}
        if not gone:
            return
        who = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(gone.items()))
        code = job_code(gone)
        raise PeerEndedError(
            f"{self._where()}: {what} (operation #{self.seq if seq is None else seq}) cannot "
            f"complete: {who} ended its script without it (sys.exit, or the script's end "
            f"reached on another path); the job ends with exit code {code}, as it would "
            "had that rank raised", gone)

    def _watch(self) -> None:
        tick = min(0.2, self.timeout / 10)
        stalled, last, watched = 0.0, time.monotonic(), None
        while not self._stopped:
            time.sleep(tick)
            if self._stopped:
                return
            # A tick far later than asked is time this process was not running (SIGSTOP, a
            # debugger): measured per watched call, as poll() does for polled waits.
            now = time.monotonic()
            active = self._active
            if active is None or active[3] != watched:
                stalled, watched = 0.0, None if active is None else active[3]
            stalled, last = max(stalled, now - last - tick), now
            if self.answer:
                try:
                    self._answer_notes()
                except Exception:  # noqa: BLE001, S112 - MPI finalized at exit: stop answering
                    return
            active = self._active
            if active is not None and self._ended():
                try:
                    self.check_ended(active[0], active[1], active[3])
                except PeerEndedError as err:
                    if self._active is not None and self._active[3] == active[3]:
                        # The blocked call can never return: say why and end the job with
                        # the ended rank's code, as its exception would have.
                        last_words(f"hadpsgd: {'error' if err.code else 'rank ended'}: {err}",
                                    err.code)
                        time.sleep(0.2)
                        self.control.Abort(err.code)
                        return
            if active is None or time.monotonic() < active[2]:
                continue
            what, group, _, seq = active
            if self._active is None or self._active[3] != seq:
                continue  # finished just now
            if time.monotonic() < self._reprieve.get(seq, 0.0):
                continue  # a killed peer: MPI fails the blocked call once it is gone
            if self.thread_multiple:
                try:
                    self.fail(what, group, stalled)
                except CommTimeoutError as err:
                    if err.peer_killed and seq not in self._reprieve:
                        # The job survives it (--on-failure continue): a note, not an error.
                        _say(f"[hadpsgd] note: {err}")
                        self._reprieve[seq] = time.monotonic() + self.timeout
                        continue
                    last_words(f"hadpsgd: error: {err}", EXIT_TIMED_OUT)
            else:  # MPI may not be called from this thread: no diagnosis, just the facts
                last_words(f"hadpsgd: error: {self._where()}: {what} did not complete within "
                            f"{self.timeout:g} s ({self.setting}); aborting the job",
                            EXIT_TIMED_OUT)
            # Give the other stuck ranks time to print their own diagnosis, then end the job:
            # the blocked call can never return an error to the caller.
            time.sleep(1.0)
            self.control.Abort(EXIT_TIMED_OUT)

    def wait(self, request: Any, what: str, group: list[int] | None = None) -> None:
        """Wait for ``request`` (an MPI request), raising :class:`CommTimeoutError` at the deadline.

        Args:
            request: The pending non-blocking request.
            what: The operation, for the error message.
            group: World ranks taking part (default: everyone); only they are asked.
        """
        self.seq += 1
        if poll(self._unless_ended(request.Test, what, group), self.timeout):
            return
        self.fail(what, group)

    def _unless_ended(self, done: Callable[[], bool], what: str,
                      group: list[int] | None) -> Callable[[], bool]:
        """``done``, raising :class:`PeerEndedError` once a peer of ``group`` ended its script."""
        if self._answering() is None:
            return done  # no monitor receives the peers' notes: the deadline decides

        def test() -> bool:
            if done():
                return True
            self.check_ended(what, group)
            return False

        return test

    def wait_all(self, requests: list[Any], what: str, group: list[int] | None = None,
                 progress: Callable[[], None] | None = None) -> None:
        """Wait for every request in ``requests`` (see :meth:`wait`).

        ``progress``, if given, is called at every poll: work the caller must keep moving
        while it waits (e.g. the gossip thread's termination agreement).
        """
        self.seq += 1
        pending = list(requests)

        def done() -> bool:
            if progress is not None:
                progress()
            pending[:] = [r for r in pending if not r.Test()]
            return not pending

        if poll(self._unless_ended(done, what, group), self.timeout):
            return
        self.fail(what, group)

    def wait_until(self, done: Callable[[], bool], what: str,
                   group: list[int] | None = None) -> None:
        """Wait for any completion test ``done`` (e.g. a gloo work item or a CUDA event)."""
        self.seq += 1
        if poll(self._unless_ended(done, what, group), self.timeout):
            return
        self.fail(what, group)

def _any_source() -> int:
    from mpi4py import MPI

    return MPI.ANY_SOURCE


__all__ = ["DEFAULT_TIMEOUT_S", "CommTimeoutError", "Guard", "PeerEndedError", "Watchdog",
           "before_abort", "job_code", "killed_peers", "last_words", "note_killed",
           "on_silent_peers", "poll", "stalled_for", "timeout_from_env"]
