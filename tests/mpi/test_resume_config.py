"""A resume runs the run it resumes: its own configuration, differences refused by name.

The runs go to a warm world (``tests/_commands.py``: ``hadpsgd.run.main`` under mpirun, the
ranks' imports paid once), except where a test rewrites a data file between runs."""

from __future__ import annotations

import json

import pytest

from tests._commands import run_command
from tests._mpi import assert_ok, run_mpi
from tests.mpi._resume import run_args

pytestmark = pytest.mark.mpi


def _config(out) -> dict:
    return json.loads((out / "config.json").read_text())


def test_a_resume_takes_the_runs_configuration_and_refuses_other_values(tiny_data, tmp_path):
    """The run had --lr 0.1 --momentum 0.5 --batch-size 8: a resume that repeats none of them
    keeps them (not the defaults); one with another batch and seed is refused with exit 2
    naming both and writing nothing; --max-steps may change; --allow-resume-change optimizer
    carries the model over to Adam (no KeyError)."""
    out = tmp_path / "hp"
    assert_ok(run_command(1, run_args(tiny_data, out, "--lr", "0.1", "--momentum", "0.5",
                                  "--batch-size", "8", "--max-steps", "4")))
    before = (out / "config.json").read_text()
    res = run_command(1, run_args(tiny_data, out, "--resume", "auto", "--batch-size", "16",
                              "--seed", "7", "--max-steps", "8"))
    assert res.returncode == 2, res.output[-3000:]
    assert "--batch-size 16 (the run has 8)" in res.stderr
    assert "--seed 7 (the run has 0)" in res.stderr
    assert "--allow-resume-change batch-size,seed" in res.stderr
    assert "Traceback" not in res.output
    assert (out / "config.json").read_text() == before  # nothing written
    res = run_command(1, run_args(tiny_data, out, "--resume", "auto", "--max-steps", "8"))
    assert_ok(res)
    assert "resumed from" in res.stdout and "at step 4" in res.stdout
    cfg = _config(out)
    assert cfg["optim"]["lr"] == 0.1 and cfg["optim"]["momentum"] == 0.5
    assert cfg["train"]["batch_size"] == 8 and cfg["train"]["max_steps"] == 8
    res = run_command(1, run_args(tiny_data, out, "--resume", "auto", "--max-steps", "10",
                              "--optimizer", "adam", "--lr", "0.001",
                              "--allow-resume-change", "optimizer,lr"))
    assert_ok(res)
    assert "with a change" in res.stdout and "--optimizer sgd (now adam)" in res.stdout
    assert _config(out)["optim"]["optimizer"] == "adam"


def test_a_resume_refuses_other_data_under_the_same_path(tiny_data, tmp_path):
    """The training file is regenerated under its old name (same dimensions, other
    utterances): the resume is refused with exit 2, naming the file and what differs, before
    anything is written; --allow-resume-change train carries the model over to it. Each run
    its own launch: a warm world (tests/_commands.py) would still hold the old file open."""
    import shutil

    from hadpsgd.data.synth import SynthSpec, generate

    data = tmp_path / "data"
    data.mkdir()
    files = (data / "train.h5", data / "heldout.h5")
    for src, dst in zip(tiny_data, files, strict=True):
        shutil.copy(src, dst)
    out = tmp_path / "run"
    assert_ok(run_mpi(1, run_args(files, out, "--batch-size", "8", "--max-steps", "4")))
    other, _ = generate(tmp_path / "other", SynthSpec(
        feat_dim=260, num_classes=12, train_utts=50, heldout_utts=12, min_len=60, max_len=120,
        seed=4))
    shutil.copy(other, files[0])
    before = (out / "config.json").read_text()
    res = run_mpi(1, run_args(files, out, "--resume", "auto", "--max-steps", "8"))
    assert res.returncode == 2, res.output[-3000:]
    assert "its data changed since that checkpoint was written: --train" in res.stderr
    assert "labels checksum" in res.stderr and "--allow-resume-change train" in res.stderr
    assert (out / "config.json").read_text() == before
    res = run_mpi(1, run_args(files, out, "--resume", "auto", "--max-steps", "8",
                              "--allow-resume-change", "train"))
    assert_ok(res)
    assert "with a change (--train data (" in res.stdout and "carried over model" in res.stdout


def test_resume_auto_where_every_checkpoint_is_damaged_is_refused(tiny_data, tmp_path):
    """Checkpoints are there but none is complete: --resume auto names each and exits 2
    instead of training another run in their place; where the run died before its first
    checkpoint it starts afresh and marks the earlier start's records void (a resume record
    at step 0)."""
    import shutil

    from hadpsgd.train.metrics import read_metrics

    out = tmp_path / "run"
    assert_ok(run_command(1, run_args(tiny_data, out, "--batch-size", "8", "--max-steps", "4",
                                  "--checkpoint-every", "2")))
    for ckpt in (out / "checkpoints").glob("step-*"):
        (ckpt / "state.pt").write_bytes(b"damaged")
    res = run_command(1, run_args(tiny_data, out, "--resume", "auto", "--max-steps", "6"))
    assert res.returncode == 2, res.output[-3000:]
    assert res.stdout.count("skipping checkpoint") == 2
    assert "holds 2 checkpoint(s) and none is complete" in res.stderr
    assert "--overwrite" in res.stderr and "Traceback" not in res.output
    shutil.rmtree(out / "checkpoints")
    res = run_command(1, run_args(tiny_data, out, "--resume", "auto", "--max-steps", "2"))
    assert_ok(res)
    assert "no checkpoint in" in res.stdout and "starting fresh" in res.stdout
    kinds = [(r["kind"], r["step"]) for r in read_metrics(out / "metrics.jsonl")]
    assert ("resume", 0) in kinds and kinds.index(("resume", 0)) > 0
