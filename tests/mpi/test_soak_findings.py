"""What the elastic soak (``scripts/soak_elastic.py``) found, under ``--with-ft ulfm``.

A job whose every rank ended by a signal is a failure: under ``mpirun --with-ft ulfm`` Open
MPI's launcher exits 0 when every rank was killed or crashed (a signal is a tolerated failure
there); the soak saw it after every rank of a job segfaulted inside ``MPI_Init``. The ranks
now note their own exits for the launcher, which turns a job without one into exit 1 with a
line saying so.

A non-blocking collective's ``MPI_ERR_OTHER`` after a peer died is a peer's failure: a learner
SIGKILLed while rank 0 wrote a checkpoint left rank 1 in the ``Ibarrier`` after it with that
error, taken for rank 1's own error (exit 1 instead of going on).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._mpi import MPI_TIMEOUT_S, ROOT, WORKERS, ranks_python
from tests.mpi.test_elastic import _launch

pytestmark = pytest.mark.mpi


def test_every_rank_killed_is_exit_1_not_0(tiny_data, tmp_path):
    res = _launch(2, tiny_data, tmp_path / "run", "--epochs", "1",
                  fault="kind=kill,rank=0,step=3;kind=kill,rank=1,step=3")
    assert res.returncode == 1, res.output[-3000:]  # before: 0
    assert "every rank of the 2 ended by a signal" in res.stderr, res.output[-3000:]


def test_a_learner_killed_and_the_others_going_on_is_still_exit_0(tiny_data, tmp_path):
    res = _launch(2, tiny_data, tmp_path / "run", "--max-steps", "8", "--control-every", "2",
                  fault="kind=kill,rank=1,step=3")
    assert res.returncode == 0, res.output[-3000:]
    assert "ended by a signal" not in res.output


def test_a_non_blocking_collectives_err_other_after_a_failure_is_a_peer_failure():
    from hadpsgd.launch import launch_env, mpirun_command

    cmd = mpirun_command(3, ["--on-failure", "continue"], module="x")[:-5]  # with --with-ft
    assert "--with-ft" in cmd
    cmd += [sys.executable, str(WORKERS / "peer_failure_other.py")]
    env = launch_env(nprocs=3)
    env.update(ranks_python())
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=env,
                         cwd=ROOT)
    said = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert said == [f"rank {r}: before False, after True, plain False" for r in (0, 1)], \
        res.stdout + res.stderr
