"""A resume at another world size on learners as threads (``tests/trainer_threads.py``):
``tests/mpi/test_resume_world.py``'s check (each chunk of the interrupted epoch trained once
over both runs, the steps after the resume only forward) for every algorithm and the plans
ADPSGD changes between (the pool growing and shrinking, the pool to one node's shards and
back). The run, its checkpoint and its resume are the main command's; only MPI is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi._resume import run_args
from tests.mpi.test_resume_world import CASES, check_resume_at_another_size
from tests.trainer_threads import train_on_threads


@pytest.mark.parametrize(("algo", "before", "after"), CASES)
def test_a_resume_at_another_size_trains_each_chunk_of_the_epoch_once(
        algo: tuple[str, ...], before: int, after: int, tiny_data: tuple[Path, Path],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(size: int, *flags: str) -> str:
        capsys.readouterr()
        train_on_threads(run_args(tiny_data, tmp_path, *flags)[2:], size,
                         env={"HADPSGD_TRACE_CHUNKS": str(tmp_path / "trace")})
        return capsys.readouterr().out

    check_resume_at_another_size(run, algo, before, after, tiny_data, tmp_path)
