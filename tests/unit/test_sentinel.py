"""The host's sentinel against real stopped processes (issue 55 item 1), no MPI.

A sibling stopped (SIGSTOP) for ``frozen_s`` seconds is killed and reported, one stopped for
less, or running, or continued in time, is not; a stopped process that is not a sibling (a
reused process id) is never hit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from hadpsgd.comm.sentinel import Sentinel, process_state


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    for _ in range(200):
        if process_state(proc.pid) == "T":
            return
        time.sleep(0.01)
    pytest.fail("the child did not stop")


def test_a_sibling_stopped_for_frozen_s_is_killed(child: subprocess.Popen[bytes]) -> None:
    told: list[list[int]] = []
    sentinel = Sentinel(0, {2: child.pid}, frozen_s=5.0, on_kill=told.append, parent=os.getpid())
    _stopped(child)
    assert sentinel.check(100.0) == [] and sentinel.check(104.9) == []
    assert sentinel.check(105.0) == [2] and told == [[2]] and sentinel.killed == [2]
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert sentinel.check(200.0) == [] and not sentinel.siblings  # never twice


def test_a_running_or_continued_sibling_is_left_alone(child: subprocess.Popen[bytes]) -> None:
    sentinel = Sentinel(0, {1: child.pid}, frozen_s=5.0, on_kill=lambda r: None,
                        parent=os.getpid())
    assert sentinel.check(0.0) == [] and sentinel.check(100.0) == []  # sleeping, not stopped
    _stopped(child)
    sentinel.check(100.0)
    os.kill(child.pid, signal.SIGCONT)  # a pause shorter than frozen_s
    time.sleep(0.05)
    sentinel.check(103.0)
    _stopped(child)
    assert sentinel.check(106.0) == []  # stopped again: counted from here
    assert child.poll() is None


def test_a_process_that_is_not_a_sibling_is_never_killed(child: subprocess.Popen[bytes]) -> None:
    sentinel = Sentinel(0, {1: child.pid}, frozen_s=1.0, on_kill=lambda r: None,
                        parent=os.getpid() + 10**6)  # another parent: a reused process id
    _stopped(child)
    sentinel.check(0.0)
    assert sentinel.check(50.0) == [] and child.poll() is None


def test_off_or_alone_starts_no_thread() -> None:
    assert Sentinel(0, {1: 1}, frozen_s=0.0, on_kill=lambda r: None).start()._thread is None
    assert Sentinel(0, {}, frozen_s=5.0, on_kill=lambda r: None).start()._thread is None
