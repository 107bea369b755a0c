"""The end of a user's script, without processes (issue 55, items 2 and 3).

A peer's end note makes a wait it takes part in fail at once with the peer's code
(:meth:`Watchdog.check_ended`, and a polled wait through it), only a wait of its group; and
``hadpsgd.init``'s ``sys.exit`` notes the main thread's exit code by Python's own rule.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from hadpsgd.api import setup
from hadpsgd.comm.deadline import CommTimeoutError, PeerEndedError, Watchdog


class Control:
    """A control communicator of 3 ranks that carries no note (the test sets ``ended``)."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 3

    def Improbe(self, **_: Any) -> None:  # noqa: N802
        return None


def _watchdog(answer: bool) -> Watchdog:
    watchdog = Watchdog(Control(), timeout=600.0, thread_multiple=answer, answer=False)
    watchdog.answer = answer  # as the main watchdog, without its monitor thread
    return watchdog


def test_an_ended_peer_of_the_group_fails_the_wait_with_its_code() -> None:
    watchdog = _watchdog(answer=True)
    watchdog.check_ended("allreduce", [0, 1])  # nobody ended: nothing to say
    watchdog.ended = {1: 7}
    with pytest.raises(PeerEndedError) as err:
        watchdog.check_ended("allreduce", [0, 1])
    assert err.value.code == 7 and err.value.missing == [1]
    assert "rank 0: allreduce (operation #0) cannot complete: rank 1 (exit code 7)" in str(
        err.value)
    watchdog.check_ended("allreduce", [0, 2])  # rank 1 takes no part in it: the wait goes on
    with pytest.raises(PeerEndedError):
        watchdog.check_ended("barrier", None)  # everyone's


def test_a_polled_wait_ends_at_the_note_not_at_the_deadline() -> None:
    watchdog = _watchdog(answer=True)
    watchdog.ended = {2: 0}
    with pytest.raises(PeerEndedError) as err:
        watchdog.wait_until(lambda: False, "broadcast", [0, 2])  # a 600 s deadline
    assert err.value.code == 0
    assert isinstance(err.value, CommTimeoutError)  # caught where a deadline's error is


def test_without_a_monitor_the_deadline_decides() -> None:
    watchdog = _watchdog(answer=False)
    watchdog.ended = {1: 7}
    done = [False, True]
    assert watchdog._unless_ended(lambda: done.pop(0), "x", None)() is False


@pytest.mark.parametrize(("status", "code"), [(None, 0), (0, 0), (7, 7), ("bye", 1)])
def test_sys_exit_is_noted_by_pythons_rule(status: object, code: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(setup, "_exit_code", None)
    with pytest.raises(SystemExit) as exited:
        setup._noted_exit(status)
    assert exited.value.code == status and setup._exit_code == code


def test_a_threads_sys_exit_is_not_the_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(setup, "_exit_code", None)

    def leave() -> None:
        with pytest.raises(SystemExit):
            setup._noted_exit(3)

    thread = threading.Thread(target=leave)
    thread.start()
    thread.join()
    assert setup._exit_code is None


def test_a_channels_wait_hears_the_end_through_the_main_watchdog() -> None:
    main = _watchdog(answer=True)
    channel = _watchdog(answer=False)  # a side or pair channel's: no monitor of its own
    channel.parent = main
    main.ended = {1: 7}
    with pytest.raises(PeerEndedError) as err:
        channel.wait_until(lambda: False, "gossip exchange", [0, 1])
    assert err.value.code == 7
