"""How a user's script under ``hadpsgd.init()`` ends when one rank ends apart (issue 55).

Item 2: a rank deadlocked in the script's own code while the others finish is named at the
end meeting's deadline (before, the others waited in ``MPI_Finalize`` forever, silent).
Item 3: ``sys.exit(N)`` on one rank ends the job with ``N``, at once, where its peers wait
for it in a collective (before: they waited for the whole deadline and exited 3, blaming it
as "dead or frozen"). Each through ``python -m hadpsgd.launch -n 2 SCRIPT``, bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hadpsgd.exit_codes import EXIT_TIMED_OUT
from tests._mpi import MPI_TIMEOUT_S, ROOT, WORKERS, ranks_python

pytestmark = pytest.mark.mpi  # each launches mpirun

SCRIPT = str((WORKERS / "api_script_end.py").relative_to(ROOT))


def _launch(*args: str, timeout_s: str) -> subprocess.CompletedProcess[str]:
    """``python -m hadpsgd.launch -n 2 SCRIPT ARGS`` under ``HADPSGD_TIMEOUT=timeout_s``."""
    env = {**os.environ, "HADPSGD_TIMEOUT": timeout_s,
           **ranks_python(os.environ.get("PYTHONPATH", ""))}
    try:
        return subprocess.run([sys.executable, "-m", "hadpsgd.launch", "-n", "2", SCRIPT, *args],
                              capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the script {' '.join(args)} did not end in {MPI_TIMEOUT_S} s (hang)\n"
                    f"{err.stdout}\n{err.stderr}")


def test_a_rank_deadlocked_in_the_script_is_named_at_the_end() -> None:
    out = _launch("deadlock", timeout_s="8")
    said = out.stdout + out.stderr
    assert out.returncode == EXIT_TIMED_OUT, said
    assert "rank 0: done" in said and "rank 1: done" not in said, said
    assert ("rank 0: the end of the script (every rank's exit)" in said
            and "rank(s) 1 never arrived (rank 1 answers: alive, in the script's own code"
            in said), said


@pytest.mark.parametrize("code", [7, 0])
def test_sys_exit_on_one_rank_ends_the_job_with_its_code(code: int) -> None:
    # A deadline far longer than the launch's own limit: only the note can end the wait.
    out = _launch("exit", str(code), timeout_s=str(int(MPI_TIMEOUT_S) * 4))
    said = out.stdout + out.stderr
    assert out.returncode == code, said
    assert "dead or frozen" not in said and "did not complete within" not in said, said
    if code:
        assert "rank 1: the script exited with code 7; ending the job" in said, said
    else:
        assert ("rank 0: intra-node allreduce (mpi) (operation" in said
                and "cannot complete: rank 1 (exit code 0) ended its script" in said), said


def test_every_rank_ending_with_sys_exit_0_is_the_normal_end() -> None:
    out = _launch("ok", timeout_s="60")
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    quiet = said.replace("[hadpsgd.launch]", "")
    assert said.count(": done") == 2 and "hadpsgd: " not in quiet, said
