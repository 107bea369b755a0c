"""The pieces of --on-failure continue that need no processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hadpsgd.comm import deadline, frozen, timeouts, ulfm
from hadpsgd.comm.deadline import CommTimeoutError


def test_a_frozen_peer_being_killed_is_a_peer_failure_through_a_chain():
    killed = CommTimeoutError("rank 1: ... rank(s) 2 did not answer", [2], peer_killed=True)
    try:
        try:
            raise killed
        except CommTimeoutError as err:
            raise RuntimeError("gossip thread failed") from err
    except RuntimeError as outer:
        assert ulfm.is_peer_failure(outer)
    assert not ulfm.is_peer_failure(CommTimeoutError("stuck, not frozen", [2]))


class _Notes:
    """Stands for the notes communicator: records what was sent to whom."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def Isend(self, buf, dest, tag):  # noqa: N802 - mpi4py's name
        self.sent.append((int(buf[0]), dest))
        return SimpleNamespace(Test=lambda: True)


@pytest.fixture
def killed(monkeypatch):
    pids: list[int] = []
    monkeypatch.setattr(frozen, "kill_pid", pids.append)
    yield pids
    deadline.on_silent_peers(None)


def _topo(hosts: list[str], rank: int) -> SimpleNamespace:
    return SimpleNamespace(hosts=hosts, pids=[100 + r for r in range(len(hosts))], rank=rank,
                           size=len(hosts), _errors=_Notes())


def test_a_learner_on_the_frozen_ones_host_kills_it_and_tells_the_others_there(killed):
    topo = _topo(["a", "a", "a", "b"], rank=3)  # rank 3 on host b found rank 1 frozen
    frozen.kill_frozen_peers(topo)
    assert timeouts.silent_handler() is not None and timeouts.silent_handler()([1])
    assert killed == []  # not on its host: it cannot kill it itself
    assert sorted(topo._errors.sent) == [(1, 0), (1, 2)]  # asks ranks 0 and 2, on host a
    topo = _topo(["a", "a", "a", "b"], rank=0)
    frozen.kill_frozen_peers(topo)
    assert timeouts.silent_handler()([1]) and killed == [101]


def test_a_frozen_learner_alone_on_its_host_cannot_be_killed(killed):
    topo = _topo(["a", "a", "b"], rank=0)
    frozen.kill_frozen_peers(topo)
    assert not timeouts.silent_handler()([2]) and killed == [] and topo._errors.sent == []


def test_a_sibling_whose_process_is_gone_is_a_peer_failure(monkeypatch):
    """The soak's round-3 finding: a learner killed in BMUF's compressed block sync cut the
    channel's all-to-all with MPI_ERR_OTHER while the world's list of failed processes
    stayed empty; its missing process on this host says it died."""
    import os
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its process id names no process
    alive = subprocess.Popen(["sleep", "30"])
    try:
        topo = SimpleNamespace(hosts=["a", "a", "b"], pids=[os.getpid(), alive.pid, gone.pid],
                               rank=0, size=3)
        monkeypatch.setattr(ulfm, "_current", topo)
        assert not ulfm._host_peer_gone()  # the dead one is on another host: not seen here
        topo.hosts = ["a", "a", "a"]
        assert ulfm._host_peer_gone()
        topo.pids = [os.getpid(), alive.pid, alive.pid]
        assert not ulfm._host_peer_gone()
    finally:
        alive.kill()
        alive.wait()
