"""What a run directory holds, and when a new run may start in it."""

import json

import pytest

from hadpsgd.assembly.rundir import clear_run, existing_run, start_problem
from hadpsgd.config import parse_config


def test_an_empty_or_foreign_directory_holds_no_run(tmp_path):
    assert existing_run(tmp_path / "missing") is None
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints").mkdir()  # empty: nothing to lose
    assert existing_run(tmp_path) is None
    assert start_problem(tmp_path, None, False) is None


def test_a_run_is_named_with_its_last_step_and_checkpoints(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"kind": "train", "step": s}) for s in (5, 10)) + "\nbroken\n")
    for step in (5, 10):
        (tmp_path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    held = existing_run(tmp_path)
    assert held == ("metrics.jsonl (up to step 10), checkpoints/ (step-00000005 .. "
                    "step-00000010)")
    msg = start_problem(tmp_path, None, False)
    assert msg is not None and "--resume auto" in msg and "--overwrite" in msg
    assert start_problem(tmp_path, "auto", False) is None  # continuing it is the point
    assert start_problem(tmp_path, None, True) is None


def test_overwrite_deletes_only_what_hadpsgd_wrote(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints" / "step-00000001").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("mine")
    assert clear_run(tmp_path) == ["config.json", "metrics.jsonl", "checkpoints/"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_overwrite_and_resume_together_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--out-dir", "x", "--resume", "auto", "--overwrite"])
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err


def test_an_out_dir_that_is_a_file_or_cannot_be_made_is_named(tmp_path):
    from hadpsgd.assembly.rundir import writable_problem

    (tmp_path / "afile").write_text("x")
    assert "is a file" in writable_problem(tmp_path / "afile")
    assert "cannot be made" in writable_problem(tmp_path / "afile" / "sub")
    assert writable_problem(tmp_path / "new" / "run") is None
    # Nothing is left behind: no directory made, the probe removed.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_overwrite_empties_a_symlinked_folder_and_keeps_the_link(tmp_path):
    """checkpoints/ linked to another disk: --overwrite empties it, keeps the link, and
    deletes config.json only with the rest (no crash half-way)."""
    run, disk = tmp_path / "run", tmp_path / "disk"
    (disk / "step-00000001").mkdir(parents=True)
    (disk / "latest").write_text("step-00000001\n")
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "checkpoints").symlink_to(disk)
    removed = clear_run(run)
    assert removed[0] == "config.json" and removed[1].startswith("checkpoints/ (the contents")
    assert (run / "checkpoints").is_symlink() and list(disk.iterdir()) == []


_HOLD = """
import sys, time
from hadpsgd.assembly.runlock import lock_run
lock_run(sys.argv[1], "the first run")
print("held", flush=True)
time.sleep(60)
"""


def test_a_live_run_holds_its_directory_and_a_dead_ones_lock_is_taken_over(tmp_path):
    """A second run is refused naming the first (host, pid, start, command); once the first
    process is gone (killed: its lock goes with it) the directory is taken over."""
    import signal
    import subprocess
    import sys

    from hadpsgd.assembly.runlock import RunDirBusy, lock_run, release_runs

    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy) as err:
            lock_run(tmp_path)
        msg = str(err.value)
        assert f"pid {holder.pid} on host" in msg and "the first run" in msg
        assert "another --out-dir" in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert lock_run(tmp_path) is None  # stale: the dead run's lock is free
    release_runs()


class _RankZero:
    """Rank 0 of a world that hears rank 0's verdicts (``check_out_dir``'s, ``make_out_dir``'s
    collectives)."""

    rank, size, num_nodes, node_sizes, device = 0, 1, 1, [1], "cpu"

    def bcast_object(self, obj: object, root: int = 0) -> object:
        return obj


def test_a_read_only_run_directory_is_a_user_error_said_by_every_rank(tmp_path, monkeypatch):
    """Issue 55 item 8d: a read-only run directory was lock_run's PermissionError on rank 0
    (a traceback, exit 1; under --on-failure continue its peers blamed it as lost)."""
    import errno
    import os

    from hadpsgd.assembly import build, runlock
    from hadpsgd.assembly.runlock import RunDirUnwritable, lock_run
    from hadpsgd.cli import ConfigError

    real_open = os.open

    def no_lock(path, *args, **kw):  # root writes anywhere: the refusal is simulated
        if str(path).endswith(runlock.LOCK_FILE):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(runlock.os, "open", no_lock)
    with pytest.raises(RunDirUnwritable, match=f"--out-dir {tmp_path} is not writable: its "
                                               "lock file .* cannot be opened for writing"):
        lock_run(tmp_path)
    cfg = parse_config(["--out-dir", str(tmp_path), "--resume", "auto"])
    with pytest.raises(ConfigError, match="make the directory .* writable for this user, or "
                                          "use another --out-dir"):
        build.check_out_dir(cfg, _RankZero())
    # A directory nothing can be written to is named before its lock is tried.
    monkeypatch.setattr(build.rundir, "writable_problem", lambda out: f"{out} is not writable")
    with pytest.raises(ConfigError, match=f"^{tmp_path} is not writable$"):
        build.check_out_dir(cfg, _RankZero())


def test_a_full_disk_at_a_resumes_start_is_one_line_said_by_every_rank(tmp_path, monkeypatch):
    """Issue 55 item 8e: a resume on a full disk was config.json's OSError on rank 0 alone (a
    traceback, exit 1, its peers aborted waiting for it); now every rank's ConfigError
    (exit 2) naming the directory and the fix, before anything is trained."""
    import errno

    from hadpsgd.assembly import build
    from hadpsgd.assembly.runlock import release_runs
    from hadpsgd.cli import ConfigError

    def full(path, *args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(path) + ".tmp")

    monkeypatch.setattr(build.provenance, "write_config", full)
    monkeypatch.setattr(build.provenance, "entry", lambda topo, resume: {})
    cfg = parse_config(["--out-dir", str(tmp_path), "--resume", "auto"])
    try:
        with pytest.raises(ConfigError, match=f"the run directory {tmp_path} could not be "
                                              "written \\(No space left on device: .*config"
                                              ".json.tmp\\); free space there"):
            build.make_out_dir(cfg, _RankZero())
    finally:
        release_runs()
