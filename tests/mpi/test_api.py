"""The public API under real mpirun: each algorithm, the deadline, and the example script.

One job runs every algorithm's checks (tests/workers/api_algorithms.py) and the example runs
once per algorithm, both on the warm world (tests/_commands.py); the deadline, which ends
its job, launches.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from hadpsgd.exit_codes import EXIT_TIMED_OUT
from hadpsgd.plot.curves import curves_of
from hadpsgd.train.metrics import read_metrics
from tests._commands import run_command, run_worker_warm
from tests._mpi import ROOT, assert_ok, run_worker

pytestmark = pytest.mark.mpi

TWO_NODES = {"HADPSGD_RANKS_PER_NODE": "2"}


def test_each_algorithm_through_the_api(tmp_path):
    # SSGD: bit-identical replicas and the big-batch process; fp16: one learner's overflow
    # skipped by all with the scale halved everywhere; BMUF: 2k steps == k, save (rank 0's
    # file), load into other weights, k; ADPSGD: every sample of 2 epochs trained once;
    # a per-step OneCycleLR under ADPSGD on the pool's position: every learner's rate alike.
    res = run_worker_warm(4, "api_algorithms", str(tmp_path), env=TWO_NODES)
    assert_ok(res)
    for phase in ("ssgd", "fp16", "bmuf", "adpsgd", "schedule"):
        assert res.stdout.count(f"OK {phase} rank") == 4, res.output[-4000:]


def test_a_learner_that_stops_stepping_is_named_within_the_deadline(tmp_path):
    start = time.monotonic()
    res = run_worker(2, "api_deadline", str(tmp_path / "run"), env={"HADPSGD_TIMEOUT": "5"})
    assert res.returncode != 0 and "NO TIMEOUT" not in res.stdout, res.output[-4000:]
    named = "rank(s) 1 never arrived (rank 1 answers: alive, in the training script after step 1"
    assert named in res.output, res.output[-4000:]
    assert time.monotonic() - start < 90
    # What the run directory keeps of it (issue 60 item 3): the step's record, then rank 0's
    # record of the failure that ended the job, which the plot marks where it happened.
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["kind"] for r in records] == ["train", "failure"], records
    failure = records[-1]
    assert failure["step"] == 1 and failure["exit_code"] == EXIT_TIMED_OUT, failure
    assert named in failure["error"] and failure["stopped"] == "the job ended", failure
    assert [(e.kind, e.step, e.note) for e in curves_of(records).events] == [
        ("failure", 1, "the job ended")]


@pytest.mark.parametrize("algo", ["ssgd", "bmuf", "adpsgd"])
def test_the_example_trains_its_own_model(algo, tiny_data, tmp_path):
    out = tmp_path / "run"
    res = run_command(4, [str(ROOT / "examples" / "own_model.py"), "--algo", algo,
                      "--train", str(tiny_data[0]), "--heldout", str(tiny_data[1]),
                      "--epochs", "2", "--run-dir", str(out), "--log-every", "2"],
                  env=TWO_NODES)
    assert_ok(res)
    found = re.search(r"held-out CTC loss ([\d.]+) -> ([\d.]+)", res.stdout)
    assert found, res.output[-4000:]
    assert float(found[2]) < 0.8 * float(found[1]), found[0]
    # What the API run left behind (issue 60): rank 0's records only, plot's names.
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["algo"] == algo and config["world"] == {
        "size": 4, "nodes": 2, "ranks_per_node": 2}
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert train and all(r["step"] % 2 == 0 and "internode_bytes" in r for r in train)
    assert len({r["step"] for r in train}) == len(train)  # one writer: no step twice
    heldout = [r["heldout_loss"] for r in records if r["kind"] == "eval"]
    assert heldout == pytest.approx([float(found[1]), float(found[2])], abs=1e-4)
