"""``python -m hadpsgd.run`` end to end under mpirun: outputs, learning, user errors.

Runs that end normally or are refused go to a warm world (``tests/_commands.py``:
``hadpsgd.run.main`` under mpirun, the ranks' imports paid once); the README's run, the
endings of a job and what a process does at its end launch as a user does. (The
learning-rate climb of a large batch and the accuracy on speech frames are the trainer's
numbers: tests/unit/test_run_threads.py, on learners as threads.)"""

import json

import h5py
import pytest

from hadpsgd.train import read_metrics
from tests._commands import run_command
from tests._mpi import assert_ok, run_mpi

pytestmark = pytest.mark.mpi


def test_two_rank_run_learns_and_writes_outputs(tiny_data, tmp_path):
    out = tmp_path / "run"
    res = run_mpi(2, ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
                      str(tiny_data[1]), "--preset", "tiny", "--epochs", "3", "--batch-size",
                      "8", "--out-dir", str(out), "--log-every", "5", "--optimizer", "adam",
                      "--lr", "0.005", "--warmup-epochs", "0"],
                  # the real torch._dynamo import beside MPI_Init (comm/preload.py), which
                  # the other launches replace with a stand-in (tests/_site/sitecustomize.py)
                  env={"HADPSGD_TEST_DYNAMO_STANDIN": "0"})
    assert_ok(res)
    evals = [m for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "eval"]
    trains = [m for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "train"]
    # once before training (step 0), then after every epoch
    assert [e["epoch"] for e in evals] == [0, 0, 1, 2] and evals[0]["step"] == 0
    assert evals[-1]["heldout_loss"] < evals[1]["heldout_loss"] < evals[0]["heldout_loss"]
    assert f"held-out loss {evals[0]['heldout_loss']:.4f} (first evaluation)" in res.stdout
    assert trains and all(t["frames_per_s"] > 0 for t in trains)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["algo"] == "ssgd" and cfg["world"]["size"] == 2
    assert (out / "checkpoints" / "latest").is_file()
    assert "metrics:" in res.stdout and "checkpoint:" in res.stdout
    # rank 0's console is in the run directory too, and the best checkpoint is named
    log = (out / "train.log").read_text()
    assert log.startswith("===== ") and " start: hadpsgd.run " in log.splitlines()[0]
    assert "[hadpsgd] before training: held-out loss" in log and "done in" in log
    best = json.loads((out / "checkpoints" / "best.json").read_text())["checkpoints"]
    assert best and best[0]["best"] and best[0]["heldout_loss"] == min(
        e["heldout_loss"] for e in evals[1:])
    # every rank evaluates the same held-out set exactly once: frames = all chunks' frames
    assert len({e["frames"] for e in evals}) == 1


def test_unknown_algo_lists_registered():
    res = run_command(2, ["-m", "hadpsgd.run", "--algo", "nope"], timeout=120)
    assert res.returncode != 0
    assert "nope" in res.stderr and "ssgd" in res.stderr


def test_malformed_file_is_named_and_job_ends(tiny_data, tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(tiny_data[0].read_bytes())
    with h5py.File(bad, "r+") as f:
        del f["offsets"]
    res = run_mpi(2, ["-m", "hadpsgd.run", "--train", str(bad), "--heldout",
                      str(tiny_data[1]), "--preset", "tiny", "--out-dir", str(tmp_path / "o")],
                  timeout=120)
    assert res.returncode != 0
    assert "bad.h5" in res.stderr and "offsets" in res.stderr


def test_missing_file_is_named(tiny_data, tmp_path):
    res = run_command(2, ["-m", "hadpsgd.run", "--train", str(tmp_path / "nope.h5"), "--heldout",
                      str(tiny_data[1])], timeout=120)
    assert res.returncode != 0
    assert "nope.h5" in res.stderr and "--train" in res.stderr


def test_resume_with_other_world_size_is_refused(tiny_data, tmp_path):
    out = tmp_path / "r"
    common = ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
              str(tiny_data[1]), "--preset", "tiny", "--out-dir", str(out), "--max-steps", "2",
              "--no-progress"]
    assert_ok(run_command(2, common))
    res = run_command(1, [*common, "--resume", "auto"], timeout=120)
    assert res.returncode != 0 and "-np 2" in res.stderr


def _snapshot(out) -> dict:
    """Every file under ``out`` with its bytes (what a refused start must leave alone)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


def test_a_fresh_start_never_mixes_with_the_run_in_its_directory(tiny_data, tmp_path):
    # The user's path of issue 25: a run of 4 steps, then a fresh one of 2 in the same
    # directory. The second must stop (exit 2) before writing anything, naming both ways on.
    out = tmp_path / "r"
    common = ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
              str(tiny_data[1]), "--preset", "tiny", "--out-dir", str(out), "--no-progress",
              "--log-every", "1"]
    assert_ok(run_command(2, [*common, "--max-steps", "4"]))
    before = _snapshot(out)
    res = run_command(2, [*common, "--max-steps", "2"], timeout=120)
    assert res.returncode == 2, res.output[-3000:]
    assert "already holds a run" in res.stderr and "--resume auto" in res.stderr
    assert "--overwrite" in res.stderr and "up to step 4" in res.stderr
    assert _snapshot(out) == before  # nothing written, nothing moved
    # --overwrite starts over: only the new run's records and checkpoints remain.
    res = run_command(2, [*common, "--max-steps", "2", "--overwrite"])
    assert_ok(res)
    steps = [m["step"] for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "train"]
    assert steps and max(steps) == 2
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002"]
    # ...and --resume auto continues it, as before.
    assert_ok(run_command(2, [*common, "--max-steps", "3", "--resume", "auto"]))


def test_a_checkpoint_of_another_preset_is_refused_by_name(tiny_data, tmp_path):
    out = tmp_path / "r"
    common = ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
              str(tiny_data[1]), "--out-dir", str(out), "--max-steps", "2", "--no-progress"]
    assert_ok(run_command(2, [*common, "--preset", "tiny"]))
    res = run_command(2, [*common, "--preset", "small", "--resume", "auto"], timeout=120)
    assert res.returncode == 2, res.output[-3000:]
    # A resume runs its run's configuration: another --preset is named as a difference.
    assert "--preset small (the run has tiny)" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("algo", [["--algo", "ssgd"],
                                  ["--algo", "bmuf", "--ranks-per-node", "1",
                                   "--sync-period", "3", "--bmuf-overlap"]])
def test_a_run_ending_on_a_checkpoint_boundary_evaluates_and_finishes(algo, tiny_data,
                                                                       tmp_path):
    # --max-steps a multiple of --checkpoint-every, inside an epoch: the periodic checkpoint
    # used to be taken first, so the run skipped its closing evaluation (and BMUF its closing
    # sync) and crashed printing the summary of an empty history.
    out = tmp_path / "r"
    res = run_command(2, ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
                      str(tiny_data[1]), "--preset", "tiny", "--out-dir", str(out),
                      "--batch-size", "4", "--max-steps", "6", "--checkpoint-every", "2",
                      "--no-progress", *algo])
    assert_ok(res)
    assert "done in" in res.stdout
    evals = [m for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 6]  # before training, and at the end
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"


def test_singleton_launch_stops_with_the_fix(tiny_data, tmp_path):
    """``srun`` without MPI support starts N processes that are each a world of one."""
    import os
    import subprocess
    import sys

    from tests._mpi import ranks_python

    env = {**os.environ, "SLURM_STEP_NUM_TASKS": "4",
           **ranks_python(os.environ.get("PYTHONPATH", ""))}
    out = subprocess.run([sys.executable, "-m", "hadpsgd.run", "--train", str(tiny_data[0]),
                          "--heldout", str(tiny_data[1]), "--preset", "tiny", "--out-dir",
                          str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "srun started 4 tasks" in out.stderr and "--mpi=pmix" in out.stderr
    assert not (tmp_path / "o").exists()  # nothing trained, nothing written


def test_loader_workers_after_mpi_init_give_the_same_run(tiny_data, tmp_path):
    """``--num-workers 2`` starts its workers after MPI init (spawned, not forked): the run
    completes on every rank and reads exactly the batches the in-process loader reads."""
    def run(workers: int) -> list[dict]:
        out = tmp_path / f"w{workers}"
        assert_ok(run_mpi(2, ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
                              str(tiny_data[1]), "--preset", "tiny", "--epochs", "2",
                              "--batch-size", "8", "--out-dir", str(out), "--no-progress",
                              "--num-workers", str(workers)]))
        return [m for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "eval"]

    in_process, workers = run(0), run(2)
    assert [e["heldout_loss"] for e in workers] == [e["heldout_loss"] for e in in_process]


def test_overlapped_reduction_through_the_main_command(tiny_data, tmp_path):
    """``--overlap on`` (buckets reduced during backward, a background thread) trains exactly
    as ``--overlap off`` through ``python -m hadpsgd.run``: same buckets, same calls."""
    def run(overlap: str) -> list[float]:
        out = tmp_path / overlap
        assert_ok(run_command(2, ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout",
                              str(tiny_data[1]), "--preset", "tiny", "--epochs", "2",
                              "--batch-size", "8", "--out-dir", str(out), "--no-progress",
                              "--overlap", overlap, "--grad-bucket-mb", "0.01",
                              "--max-grad-norm", "1"]))
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["comm"]["overlap"] == overlap
        return [m["heldout_loss"] for m in read_metrics(out / "metrics.jsonl")
                if m["kind"] == "eval"]

    assert run("on") == run("off")


def test_ranks_started_with_different_options_are_refused(tiny_data, tmp_path):
    """An MPMD command line gives rank 1 another --lr: refused on every rank before anything
    is written (it trained silently at its own rate before), the option named once."""
    import sys

    args = ["-m", "hadpsgd.run", "--train", str(tiny_data[0]), "--heldout", str(tiny_data[1]),
            "--preset", "tiny", "--max-steps", "2", "--no-progress", "--out-dir",
            str(tmp_path / "run")]
    res = run_mpi(1, [*args, ":", "-np", "1", sys.executable, *args, "--lr", "0.9"])
    assert res.returncode == 2, res.output[-3000:]
    assert res.stderr.count("the ranks were started with different options: rank 1 has "
                            "--lr 0.9 (rank 0 has 0.5)") == 1, res.output[-3000:]
    assert not (tmp_path / "run").exists()
