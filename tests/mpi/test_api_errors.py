"""A user's mistake under MPI, said as the CLI says one (issue 47, item 3).

Every rank finds it, rank 0 says it in one line, every rank exits 2, and neither Open MPI's
abort banner nor (under ``python -m hadpsgd.launch``) its ``Exit code: 2`` banner follows;
the same for ``hadpsgd.run``'s mistyped flag, which also gets the flag it resembles. Five
2-rank launches, each under a wall-clock limit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hadpsgd.exit_codes import EXIT_USER_ERROR
from tests._mpi import MPI_TIMEOUT_S, ROOT, WORKERS, ranks_python

pytestmark = pytest.mark.mpi  # each launches mpirun

WORKER = str((WORKERS / "api_user_error.py").relative_to(ROOT))  # a relative script path
MESSAGE = "hadpsgd: error: bmuf option sync_period must be > 0, got 0"
BANNERS = ("Process name", "MPI_ABORT", "Traceback", "prterun")


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m hadpsgd.launch -n 2 ARGS`` from the repository root, bounded in time."""
    env = {**os.environ, "HADPSGD_TIMEOUT": "60",
           **ranks_python(os.environ.get("PYTHONPATH", ""))}
    try:
        return subprocess.run([sys.executable, "-m", "hadpsgd.launch", "-n", "2", *args],
                              capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"hadpsgd.launch {' '.join(args)} did not end in {MPI_TIMEOUT_S} s "
                    f"(hang?)\n{err.stdout}\n{err.stderr}")


@pytest.mark.parametrize("where", ["after-init", "before-init"])
def test_a_bad_option_is_said_once_with_exit_2(where: str) -> None:
    out = _launch(WORKER, where)
    said = out.stdout + out.stderr
    assert out.returncode == EXIT_USER_ERROR, said
    assert said.count(MESSAGE) == 1, said
    assert not [b for b in BANNERS if b in said], said


def test_a_bad_option_on_one_rank_only_aborts_naming_it() -> None:
    out = _launch(WORKER, "one-rank")
    said = out.stdout + out.stderr
    assert out.returncode == EXIT_USER_ERROR, said
    assert "hadpsgd: rank 1: error: bmuf option sync_period must be > 0" in said, said


def test_a_mistyped_flag_under_the_launcher() -> None:
    out = _launch("--epoch", "3")
    said = out.stdout + out.stderr
    assert out.returncode == EXIT_USER_ERROR, said
    assert said.count("unrecognized arguments: --epoch 3; did you mean --epochs?") == 1, said
    assert "Process name" not in said and "Exit code" not in said, said


def test_init_quiets_the_ucx_one_sided_component_under_a_plain_mpirun() -> None:
    from hadpsgd.launch import launch_env, mpirun_command

    cmd = mpirun_command(2, [], module="x")[:-3]  # mpirun and its local flags only
    env = launch_env(nprocs=2)
    del env["OMPI_MCA_osc"]  # what a plain mpirun leaves unset: hadpsgd.init sets it
    env.update(HADPSGD_RANKS_PER_NODE="1", HADPSGD_TIMEOUT="60",
               **ranks_python(env.get("PYTHONPATH", "")))
    try:
        out = subprocess.run([*cmd, sys.executable, WORKER, "adpsgd-ok"], capture_output=True,
                             text=True, timeout=MPI_TIMEOUT_S, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mpirun did not end in {MPI_TIMEOUT_S} s (hang?)\n{err.stdout}\n"
                    f"{err.stderr}")
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    assert said.count("done") == 2 and "OSC UCX" not in said, said
