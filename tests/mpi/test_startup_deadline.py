"""A learner frozen or stuck in start-up ends every rank within the deadline (issue 43).

Before, a rank frozen before ``MPI_Init`` (or between two of the start-up's blocking calls)
left every other rank waiting forever: no deadline covered start-up. Each case freezes
(SIGSTOP) or hangs one rank at a start-up point through ``HADPSGD_FAULT`` and checks that
the job ends with exit 3 (timed out) within the deadline plus a margin, that the live ranks
name the frozen rank and their own phase in lines of one form, and that no rank promises a
checkpoint while the launcher ends it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from hadpsgd.exit_codes import EXIT_TIMED_OUT
from tests._mpi import MPIResult, run_mpi
from tests.mpi.test_elastic import _launch
from tests.mpi.test_faults import fault_time

pytestmark = pytest.mark.mpi

TIMEOUT_S = 6.0
# The diagnosis grace (<= timeout/2, at most 5 s), the abort pause, mpirun's teardown, and
# start-up on two busy shared cores.
MARGIN_S = 25.0

CASES = {
    # at, kind, ranks, the phase the live ranks name, who answers (a hung rank's watchdog)
    "never-reaches-mpi": ("startup-mpi", "stop", 3, "MPI set-up", None),
    "frozen-in-data-checks": ("startup-data", "stop", 2, "data checks", None),
    "stuck-before-model-broadcast": ("startup-model", "hang", 2, "model broadcast",
                                     "alive, starting up: model broadcast"),
}


def _args(data: tuple[Path, Path], out: Path) -> list[str]:
    return ["--train", str(data[0]), "--heldout", str(data[1]), "--preset", "tiny",
            "--max-steps", "3", "--batch-size", "4", "--no-progress", "--out-dir", str(out)]


def _check(res: MPIResult, nprocs: int, phase: str, answers: str | None) -> None:
    ended = time.time()
    out = res.output
    took = ended - fault_time(out)
    print(f"START-UP FAULT ({phase}): exit {res.returncode}, the job ended {took:.1f} s after "
          "the fault")
    assert res.returncode == EXIT_TIMED_OUT, out[-4000:]
    assert took < TIMEOUT_S + MARGIN_S, f"the job took {took:.1f} s to end\n{out[-4000:]}"
    # Lines of one form: the rank, its phase, the missing rank 1. In MPI's set-up each rank's
    # deadline runs from its own MPI_Init, and the launcher ends the others as soon as the
    # first gives up, so only some of them may have said it; in a collective every rank
    # waiting in it has its say (the diagnosis grace).
    lines = re.findall(r"hadpsgd: error: rank (\d+) \(start-up: ([^)]+)\): (.*)", res.stderr)
    said = {int(rank) for rank, _, _ in lines} - {1}
    assert said, out[-4000:]
    if phase != "MPI set-up":
        assert said == set(range(nprocs)) - {1}, out[-4000:]
    for rank, where, text in lines:
        if rank == "1":
            assert "this rank was itself stopped" in text, text  # woken by the launcher
            continue
        assert "rank(s) 1 never arrived" in text, text
        assert where == phase or (rank != "0" and phase == "model broadcast"), text
        if answers:
            assert f"rank 1 answers: {answers}" in text, text
    assert "mismatched call order" not in out, out[-4000:]
    assert "received: stopping" not in out and "will checkpoint" not in out, out[-4000:]
    assert "[hadpsgd] done in" not in out


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_frozen_in_start_up_ends_the_job_within_the_deadline(case, tiny_data,
                                                                     tmp_path) -> None:
    at, kind, nprocs, phase, answers = CASES[case]
    res = run_mpi(nprocs, ["-m", "hadpsgd.run", *_args(tiny_data, tmp_path / "run")],
                  env={"HADPSGD_TIMEOUT": str(TIMEOUT_S),  # the phases after MPI's set-up
                       "HADPSGD_START_TIMEOUT": str(TIMEOUT_S),  # MPI's set-up
                       "HADPSGD_FAULT": f"kind={kind},rank=1,at={at}"}, timeout=180)
    _check(res, nprocs, phase, answers)
    if phase == "MPI set-up":  # the rank on this host that never came, and why
        assert re.search(r"rank 1, pid \d+ on this host: stopped", res.stderr), res.stderr


def test_under_on_failure_continue_start_up_still_ends_the_job(tiny_data, tmp_path) -> None:
    """No trained state exists yet: a frozen learner in start-up is not killed and gone on
    from (as one in training is), the job ends as without the option. (The heartbeat
    detector and the host's sentinel, off here, end it sooner, exit 1:
    tests/mpi/test_elastic.py, tests/mpi/test_frozen.py.)"""
    res = _launch(2, tiny_data, tmp_path / "run", "--max-steps", "3",  # adds --on-failure
                  fault="kind=stop,rank=1,at=startup-data", timeout=str(TIMEOUT_S),
                  env_extra={"OMPI_MCA_mpi_ft_detector": "false", "HADPSGD_FROZEN_S": "0"})
    _check(res, 2, "data checks", None)
    assert "killed by a learner on its host" not in res.output
