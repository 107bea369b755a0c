"""Non-finite loss or gradients: every learner that shares the step skips it, and past
``--max-nonfinite`` every rank stops with a message naming the step and the rank."""

from __future__ import annotations

import json

import pytest

from tests._commands import run_command
from tests._mpi import assert_ok, run_mpi
from tests.mpi._resume import run_args

pytestmark = pytest.mark.mpi


# The NaN gradient skipped by exactly the learners that share it, for every algorithm, runs on
# learners as threads (tests/unit/test_nonfinite_threads.py, tests/nonfinite_suite.py's
# checks); here the main command's skips (on the warm world: tests/_commands.py) and its
# stops, which end the job with MPI_Abort, under mpirun.
def test_run_skips_then_finishes(tiny_data, tmp_path):
    res = run_command(2, run_args(tiny_data, tmp_path, "--batch-size", "4", "--max-steps", "20",
                              "--log-every", "5"),
                  env={"HADPSGD_FAULT": "kind=nan,rank=1,step=4,count=2"})
    assert_ok(res)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert train and train[-1]["skipped_steps"] == 2
    evals = [x for x in lines if "heldout_loss" in x]
    assert evals and all(x["heldout_loss"] == x["heldout_loss"] for x in evals)  # not NaN


@pytest.mark.parametrize("algo", ["ssgd", "bmuf"])
def test_too_many_nonfinite_stops_every_rank(algo, tiny_data, tmp_path):
    extra = ["--ranks-per-node", "1"] if algo == "bmuf" else []
    res = run_mpi(2, run_args(tiny_data, tmp_path, "--algo", algo, "--batch-size", "4",
                              "--max-steps", "20", "--max-nonfinite", "2", "--control-every",
                              "5", *extra),
                  env={"HADPSGD_FAULT": "kind=nan,rank=1,step=3,count=5"})
    from hadpsgd.run import EXIT_DIVERGED

    assert res.returncode == EXIT_DIVERGED, res.output[-3000:]
    assert res.stderr.count("more than --max-nonfinite 2") == 1  # rank 0 says it, once
    assert "hadpsgd: error: " in res.stderr and "rank 1: error" not in res.stderr
    assert "step 3 on rank 1 (loss)" in res.stderr
    assert "Traceback" not in res.stderr
    assert "[hadpsgd] done in" not in res.stdout


@pytest.mark.parametrize(("algo", "extra"), [("ssgd", []),
                                             ("bmuf", ["--ranks-per-node", "1",
                                                       "--optimizer", "sgd"]),
                                             ("adpsgd", ["--super-learner-size", "1"])])
def test_finite_divergence_stops_every_rank(algo, extra, tiny_data, tmp_path):
    # A rate far too high, clipped so that nothing becomes NaN: the loss explodes but stays
    # finite, which only the divergence guard sees.
    res = run_mpi(2, run_args(tiny_data, tmp_path, "--algo", algo, "--batch-size", "4",
                              "--max-steps", "60", "--log-every", "5", "--lr", "300",
                              "--max-grad-norm", "1", "--max-loss-ratio", "2", *extra))
    from hadpsgd.run import EXIT_DIVERGED

    assert res.returncode == EXIT_DIVERGED, res.output[-3000:]
    assert "the run diverged" in res.stderr and "--max-loss-ratio 2" in res.stderr
    assert res.stderr.count("the run diverged") == 1, res.stderr[-3000:]
    assert "Lower --lr" in res.stderr
    assert "Traceback" not in res.stderr
    assert "[hadpsgd] done in" not in res.stdout
