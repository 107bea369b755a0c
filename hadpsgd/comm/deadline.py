"""Deadlines on every blocking wait, so that a dead or missing peer becomes an error, not a hang.

When a collective times out, the ranks that are stuck in it tell each other so over a separate
control communicator; whoever does not answer within a short grace period is named in the
error as the peer that never arrived.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hadpsgd import env
from hadpsgd.exit_codes import EXIT_TIMED_OUT

DEFAULT_TIMEOUT_S = env.DEFAULT_TIMEOUT_S
"""Deadline in seconds when ``HADPSGD_TIMEOUT`` is not set."""

_DIAG_TAG = 7_771
"""Tag of the "I am stuck in operation #seq" messages on the control communicator."""
_REPLY_TAG = 7_772
"""Tag of the answers "I am alive, doing <activity>" to a stuck peer's note."""
_REPLY_BYTES = 160
_END_TAG = 7_773
"""Tag of the note "I have ended my script, with this exit code" (:meth:`Watchdog.announce_end`)."""


class CommTimeoutError(RuntimeError):
    """A communication operation did not complete before its deadline.

    Attributes:
        missing: Ranks (of the communicator that timed out, as world ranks) that never
            arrived, when they could be determined.
    """

    def __init__(self, message: str, missing: list[int] | None = None,
                 peer_killed: bool = False) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.peer_killed = peer_killed
        """The silent peers were frozen and are being killed (``--on-failure continue``): a
        peer failure the survivors go on from, not the end of the job."""


class PeerEndedError(CommTimeoutError):
    """A peer this rank waits for has ended its script: the wait can never complete.

    Attributes:
        code: The exit code the peer ended with: the job ends with it, as it would had the
            peer raised.
    """

    def __init__(self, message: str, ended: dict[int, int]) -> None:
        super().__init__(message, missing=sorted(ended))
        self.code = job_code(ended)


def job_code(ended: dict[int, int]) -> int:
    """The code a job ends with when the ranks ``ended`` (rank -> code) left.

    The first non-zero one, else 0.
    """
    return next((c for c in ended.values() if c), 0)


_silent_handler: Callable[[list[int]], bool] | None = None


def on_silent_peers(handler: Callable[[list[int]], bool] | None) -> None:
    """Call ``handler(ranks)`` when peers past a deadline do not answer (dead or frozen).

    ``hadpsgd.comm.ulfm`` sets it under ``--on-failure continue``: a frozen learner is
    killed by a learner on its host, so that MPI's failure mitigation finds it gone and the
    others go on. It returns whether the peers will be killed.
    """
    global _silent_handler  # noqa: PLW0603 - one policy per process
    _silent_handler = handler


_killed: list[int] = []
"""The world ranks this process's watchdogs found silent and had killed (see
:func:`on_silent_peers`)."""


def killed_peers() -> list[int]:
    """The peers this process had killed as frozen (an error that follows is their death)."""
    return list(_killed)


def note_killed(ranks: list[int] | None) -> None:
    """Record ``ranks`` as killed by this process as frozen (see :func:`killed_peers`).

    None forgets them all: a new world after a recovery, where they are gone.
    """
    if ranks is None:
        _killed.clear()
    else:
        _killed.extend(ranks)


def timeout_from_env() -> float:
    """The deadline in seconds from env ``HADPSGD_TIMEOUT`` (default 300).

    Kept here (and in :mod:`hadpsgd.comm`) for callers of the communication layer; the parsing
    is :func:`hadpsgd.env.timeout`'s.

    Raises:
        hadpsgd.env.EnvError: If the variable is set but is not a positive number (a
            ``ValueError``, as before).
    """
    return env.timeout()


def poll(done: Callable[[], bool], timeout: float) -> bool:
    """Call ``done()`` until it returns True or ``timeout`` seconds pass; returns the last value.

    It spins (yielding the core between tests) for the first millisecond, where almost every
    operation completes, as a blocking MPI call would; then it sleeps with a growing pause,
    which leaves the cores to the other ranks when a peer is slow or several share a CPU.
    """
    if done():
        return True
    start = time.monotonic()
    spin_until = start + 1e-3
    while time.monotonic() < spin_until:
        if done():
            return True
        os.sched_yield()
    deadline = start + timeout
    pause = 50e-6
    last, longest = start, 0.0
    while not done():
        now = time.monotonic()
        # The monotonic clock runs on while the process is stopped (SIGSTOP, a debugger):
        # a gap far longer than the pause is time this rank itself was not running.
        longest, last = max(longest, now - last), now
        if now > deadline:
            _stall.seconds = longest
            return False
        time.sleep(pause)
        pause = min(pause * 1.5, 1e-3)
    return True


_stall = threading.local()
"""The longest gap between two checks of this thread's last timed-out :func:`poll`."""


def stalled_for() -> float:
    """Seconds this thread was not running during its last timed-out wait (0 if none)."""
    return float(getattr(_stall, "seconds", 0.0))


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


class Watchdog:
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

    def _answering(self) -> Watchdog | None:
        """The watchdog whose monitor answers peers' notes for this one.

        Itself, its parent (a channel's), or None (no monitor: only the deadline tells).
        """
        if self.answer:
            return self
        return self.parent if self.parent is not None and self.parent.answer else None

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
                handler = _silent_handler if not self.phase else None
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


def _any_source() -> int:
    from mpi4py import MPI

    return MPI.ANY_SOURCE


_BEFORE_ABORT: list[Callable[[str, int], None]] = []
"""Told ``(the line said, the exit code)`` before hadpsgd ends the job (see below)."""


def before_abort(note: Callable[[str, int], None]) -> Callable[[], None]:
    """Have ``note(line, code)`` called before hadpsgd ends the job for a failure.

    Told by :func:`last_words`: the watchdog's thread, where a blocked call can never return
    and no exception reaches the script, and ``hadpsgd.init``'s hook for an exception that
    escapes it. A run directory's record of the end is written here
    (``hadpsgd.Distributed(run_dir=)``). A note that fails is ignored. Returns the call that
    takes the note back.
    """
    _BEFORE_ABORT.append(note)
    return lambda: _BEFORE_ABORT.remove(note) if note in _BEFORE_ABORT else None


def last_words(line: str, code: int) -> None:
    """Say ``line`` (``hadpsgd: ...``) and tell the notes of :func:`before_abort`.

    Each note gets the line without its prefix and ``code``; none stops the abort that follows.
    """
    _say(line)
    for note in list(_BEFORE_ABORT):
        try:
            note(line.removeprefix("hadpsgd: "), code)
        except Exception:  # noqa: BLE001, S110 - the job ends whatever a record does
            pass


def _say(line: str) -> None:
    """Write one line to stderr in a single write call.

    print() writes the text and the newline separately; under MPICH's launcher two ranks'
    lines could interleave between the two.
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
