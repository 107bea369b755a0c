"""``python -m hadpsgd.launch``: one's own script by path, Open MPI's exit-2 banner dropped,
and a mistyped flag of ``hadpsgd.run`` answered with the flag it resembles (issue 47)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hadpsgd.cli import RankParser
from hadpsgd.launch import Launcher, LauncherError, mpirun_command
from hadpsgd.launch.__main__ import main, split_script
from hadpsgd.launch.banner import BannerFilter

OPENMPI = Launcher("/x/mpirun", "openmpi")
BANNER = (b"-" * 74 + b"\nprterun detected that one or more processes exited with non-zero "
          b"status,\nthus causing the job to be terminated. The first process to do so "
          b"was:\n\n   Process name: [prterun-vm-1@1,1]\n   Exit code:    {code}\n"
          + b"-" * 74 + b"\n")


def _banner(code: int) -> bytes:
    return BANNER.replace(b"{code}", str(code).encode())


def _through(data: bytes, piece: int = 7) -> bytes:
    """``data`` through a filter, fed in small pieces as a pipe may deliver it."""
    banner = BannerFilter()
    out = b"".join(banner.feed(data[i:i + piece]) for i in range(0, len(data), piece))
    return out + banner.flush()


def test_script_split_from_the_launchers_options(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert split_script(["-n", "2", "train.py", "--lr", "0.1", "-n", "5"]) == (
        ["-n", "2"], "train.py", ["--lr", "0.1", "-n", "5"])
    assert split_script(["--nprocs=3", "--dry-run", "./train.py"]) == (
        ["--nprocs=3", "--dry-run"], "./train.py", [])
    # hadpsgd.run's flags (with or without --), and --module: no script.
    for argv in (["-n", "2", "--algo", "ssgd"], ["-n", "2", "--", "train.py"],
                 ["--module", "m", "train.py"]):
        assert split_script(argv) == (argv, None, [])


def test_a_mistyped_launcher_option_before_a_script_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    with pytest.raises(LauncherError, match=r"--nproc \(did you mean --nprocs\?\) before the "
                                            "script train.py"):
        split_script(["--nproc", "2", "train.py"])


def test_script_command_and_a_missing_script(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    cmd = mpirun_command(2, ["--on-failure", "continue"], launcher=OPENMPI, python="p",
                         script="train.py")
    # A script's arguments are its own: no --with-ft from what hadpsgd.run would read.
    assert cmd == ["/x/mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "p",
                   "train.py", "--on-failure", "continue"]
    with pytest.raises(LauncherError, match="no script nope.py .*--module NAME"):
        mpirun_command(2, [], launcher=OPENMPI, python="p", script="nope.py")


def test_dry_run_of_a_script_and_of_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert main(["-n", "3", "--dry-run", "train.py", "--epochs", "2"]) == 0
    line = capsys.readouterr().out
    assert " -np 3 " in line and line.rstrip().endswith(" train.py --epochs 2")
    assert main(["-n", "2", "--dry-run", "--algo", "ssgd"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("-m hadpsgd.run --algo ssgd")
    with pytest.raises(SystemExit) as ended:
        main(["-n", "2", "--dry-run", "missing.py"])
    assert ended.value.code == 2
    assert "no script missing.py" in capsys.readouterr().err


def test_help_names_both_entry_points() -> None:
    out = subprocess.run([sys.executable, "-m", "hadpsgd.launch", "--help"],
                         capture_output=True, text=True, timeout=60).stdout
    assert "SCRIPT.py [ARGS ...]" in out and "--module NAME" in out
    assert "goes to the script" in " ".join(out.split())


def test_the_exit_2_banner_is_dropped_and_everything_else_kept() -> None:
    before, after = b"python -m hadpsgd.run: error: bad\n", b"tail\n"
    assert _through(before + _banner(2) + after) == before + after
    for code in (1, 3, 75):  # another code: the banner is Open MPI's only word on it
        assert _through(before + _banner(code)) == before + _banner(code)
    other = b"-" * 40 + b"\nMPI_ABORT was invoked on rank 0\n" + b"-" * 40 + b"\n"
    assert _through(other + other) == other + other
    assert _through(b"----- not a rule\n-- x") == b"----- not a rule\n-- x"


def test_a_line_without_its_newline_passes_at_once() -> None:
    banner = BannerFilter()
    assert banner.feed(b"step 10/100\r") == b"step 10/100\r"
    assert banner.feed(b"step 20/100\r") == b"step 20/100\r"
    assert banner.feed(b"-" * 30 + b"\n") == b"-" * 30 + b"\n"  # the same line goes on
    assert banner.feed(b"done\n") == b"done\n"
    assert banner.feed(b"-" * 30) == b""  # a rule may be arriving: held to its newline
    assert banner.feed(b"\nsomething else\n") == b"-" * 30 + b"\nsomething else\n"


def test_a_mistyped_flag_gets_the_flag_it_resembles(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from hadpsgd.config import parse_config

    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    with pytest.raises(SystemExit) as ended:
        parse_config(["--epoch", "3"])
    assert ended.value.code == 2
    assert "unrecognized arguments: --epoch 3; did you mean --epochs?" in capsys.readouterr().err
    parser = RankParser(prog="p", allow_abbrev=False)
    parser.add_argument("--epochs")
    parser.add_argument("--lr")
    with pytest.raises(SystemExit):
        parser.parse_args(["--epoch", "1", "--lrr=2", "--zzz"])
    err = capsys.readouterr().err
    assert "did you mean --epochs for --epoch?; did you mean --lr for --lrr?" in err


def test_the_run_says_its_error_first_and_the_options_on_request(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 60 item 5: the error was the 48th line, after 47 of usage. Now it is the first;
    # a parser whose usage is short keeps argparse's usage-then-error.
    from hadpsgd.config import parse_config

    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    with pytest.raises(SystemExit) as ended:
        parse_config(["--algo", "foo"])
    assert ended.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("python -m hadpsgd.run: error: argument --algo: invalid choice")
    assert len(lines) == 2 and "--help lists them" in lines[1]
    parser = RankParser(prog="p", allow_abbrev=False)
    parser.add_argument("--epochs")
    with pytest.raises(SystemExit):
        parser.parse_args(["--zzz"])
    assert capsys.readouterr().err.splitlines()[0] == "usage: p [-h] [--epochs EPOCHS]"


def test_hadpsgds_own_warnings_are_one_line_under_the_api_too() -> None:
    # A script's user saw "…/hadpsgd/algorithms/bmuf/algorithm.py:124: RuntimeWarning: …".
    import warnings

    from hadpsgd.cli import install_warning_format

    before = warnings.formatwarning
    try:
        install_warning_format()
        own = warnings.formatwarning("no nodes to average", RuntimeWarning,
                                     "/x/hadpsgd/algorithms/bmuf/algorithm.py", 124)
        other = warnings.formatwarning("old", DeprecationWarning, "/x/user.py", 3)
    finally:
        warnings.formatwarning = before
    assert own == "[hadpsgd] warning: no nodes to average\n"
    assert other.startswith("/x/user.py:3: DeprecationWarning: old")


_FLAKY_MPIRUN = """
import sys
from pathlib import Path
tries = Path(sys.argv[1])
n = len(tries.read_text()) if tries.exists() else 0
tries.write_text("x" * (n + 1))
if n < int(sys.argv[2]):
    sys.stderr.write("The PMIx server's listener thread failed to start\\n")
    sys.exit(213)
sys.stderr.write("ran\\n")
sys.exit(int(sys.argv[3]))
"""


@pytest.mark.parametrize("start_failures, code, launches, returned", [
    (1, 0, 2, 0),    # the launcher failed once: started again, the job's own exit
    (9, 0, 3, 213),  # it never starts: given up after three launches, its code kept
    (0, 5, 1, 5),    # the job itself failed: never started again
])
def test_the_launcher_starts_mpirun_again_only_where_no_rank_ran(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], start_failures: int, code: int,
        launches: int, returned: int) -> None:
    from hadpsgd.launch.forward import run_forwarding

    script, tries = tmp_path / "mpirun.py", tmp_path / "tries"
    script.write_text(_FLAKY_MPIRUN)
    cmd = [sys.executable, str(script), str(tries), str(start_failures), str(code)]
    assert run_forwarding(cmd, {}) == returned
    assert len(tries.read_text()) == launches
    err = capfd.readouterr().err
    assert err.count("starting it again") == launches - 1
    assert err.count("listener thread failed") == min(start_failures, launches)
