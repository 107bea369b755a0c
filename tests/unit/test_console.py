"""A progress bar only where the run's output reaches a terminal; plain lines anywhere else.

Under a plain ``mpirun … > log`` a rank's own stdout is Open MPI's pty: the rule asks the
launcher's streams instead (issue 47, item 8).
"""

import os
import subprocess
import sys

import pytest

from hadpsgd.train import console
from hadpsgd.train.progress import on_terminal
from tests._mpi import ROOT


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:  # pytest may print through it
        return len(text)

    def flush(self) -> None:
        pass


def _fake_proc(tmp_path, name, out, err, pid=4242):
    """A /proc with one process ``pid`` named ``name`` whose stdout and stderr lead there."""
    (tmp_path / str(pid) / "fd").mkdir(parents=True)
    (tmp_path / str(pid) / "comm").write_text(name + "\n")
    os.symlink(out, tmp_path / str(pid) / "fd" / "1")
    os.symlink(err, tmp_path / str(pid) / "fd" / "2")
    return tmp_path


@pytest.mark.parametrize("out, err, bar", [(True, True, True), (True, False, False),
                                           (False, True, False), (False, False, False)])
def test_outside_a_launcher_both_streams_must_be_terminals(monkeypatch, out, err, bar):
    monkeypatch.setattr(sys, "stdout", _Stream(out))
    monkeypatch.setattr(sys, "stderr", _Stream(err))
    assert console.reaches_terminal(environ={}) is bar


@pytest.mark.parametrize("out, err, bar", [
    ("/dev/pts/3", "/dev/pts/3", True),       # mpirun at a terminal
    ("/tmp/log", "/dev/pts/3", False),        # mpirun … > log
    ("/dev/pts/3", "pipe:[991]", False),      # mpirun … 2>&1 | tee log
    ("/tmp/log", "/tmp/log", False),          # mpirun … > log 2>&1
])
def test_a_rank_of_a_local_launcher_asks_the_launchers_streams(monkeypatch, tmp_path, out,
                                                                err, bar):
    # The rank's own streams lie (a pty, a pipe): they must not be asked.
    monkeypatch.setattr(sys, "stdout", _Stream(True))
    monkeypatch.setattr(sys, "stderr", _Stream(False))
    monkeypatch.setattr(console.os, "getppid", lambda: 4242)
    proc = _fake_proc(tmp_path, "prterun", out, err)
    assert console.reaches_terminal({"OMPI_COMM_WORLD_RANK": "0"}, proc) is bar


def test_a_rank_that_cannot_see_its_launcher_writes_lines(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdout", _Stream(True))
    monkeypatch.setattr(sys, "stderr", _Stream(True))
    monkeypatch.setattr(console.os, "getppid", lambda: 4242)
    # A remote rank: its parent is Open MPI's daemon, whose streams say nothing of the user's.
    daemon = _fake_proc(tmp_path / "a", "prted", "/dev/pts/1", "/dev/pts/1")
    assert console.reaches_terminal({"PMIX_RANK": "3"}, daemon) is False
    # No /proc to read (another OS).
    assert console.reaches_terminal({"PMIX_RANK": "3"}, tmp_path / "none") is False


def test_the_launchers_word_comes_first(monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Stream(False))
    monkeypatch.setattr(sys, "stderr", _Stream(False))
    monkeypatch.setenv("HADPSGD_STDOUT_TTY", "1")
    assert on_terminal() is True
    monkeypatch.setenv("HADPSGD_STDOUT_TTY", "0")
    monkeypatch.setattr(sys, "stdout", _Stream(True))
    monkeypatch.setattr(sys, "stderr", _Stream(True))
    assert on_terminal() is False
    monkeypatch.delenv("HADPSGD_STDOUT_TTY")
    for name in console.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert on_terminal() is True


def test_plain_mpirun_into_a_file_gives_lines(tmp_path):
    """The real case: ``mpirun -np 1 python … > log``, whose rank's stdout is a pty."""
    from hadpsgd.launch import launch_env, mpirun_command

    cmd = [*mpirun_command(1, [], module="x")[:-3], sys.executable, "-c",
           "import sys; from hadpsgd.train.progress import on_terminal; "
           "print('tty', sys.stdout.isatty(), 'bar', on_terminal())"]
    env = launch_env(nprocs=1)  # what a plain mpirun needs here (e.g. to run as root)
    env.pop("HADPSGD_STDOUT_TTY", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    log = tmp_path / "log"
    with open(log, "w") as out:
        res = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, timeout=120,
                             env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "bar False" in log.read_text(), log.read_text()
