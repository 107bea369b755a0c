"""What the main command's run writes, through its trainer on learners as threads
(``tests/trainer_threads.py``): the learning-rate climb of a large batch and its resume on
the climb, the accuracy on speech frames where the data names silence. Their numbers are the
trainer's, not the processes': they ran under mpirun before (``tests/mpi/test_run_cli.py``
keeps the command's own endings, launches and refusals)."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from hadpsgd.data import mark_silence
from hadpsgd.train import read_metrics
from tests.trainer_threads import train_on_threads


def _flags(data: tuple[Path, Path], out: Path, *extra: str, heldout: Path | None = None
           ) -> list[str]:
    return ["--train", str(data[0]), "--heldout", str(heldout or data[1]), "--preset", "tiny",
            "--out-dir", str(out), "--no-progress", *extra]


def test_a_large_batch_climbs_from_the_base_rate_step_by_step_and_resumes_on_the_climb(
        tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    # Global batch 16 at --base-batch 4: the scaled rate 4 x 0.05 = 0.2. Goyal et al.'s
    # gradual warm-up starts at the base batch's 0.05 and reaches 0.2 at the end of the
    # first epoch; the next epoch anneals from 0.2. A run stopped on the climb and resumed
    # steps at the same rates as one that never stopped.
    def run(out: Path, *extra: str) -> dict[int, tuple[int, float]]:
        train_on_threads(_flags(tiny_data, out, "--log-every", "1", "--epochs", "2",
                                "--batch-size", "8", "--base-batch", "4", "--lr", "0.05",
                                *extra), 2)
        return {m["step"]: (m["epoch"], round(m["lr"], 12))
                for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "train"}

    whole = run(tmp_path / "whole")
    first = [lr for epoch, lr in whole.values() if epoch == 0]
    steps = len(first)
    assert steps >= 3
    # step k of n trains at 0.05 + 0.15 k / n (k from 0): rising, below the peak
    assert first == pytest.approx([0.05 + 0.15 * k / steps for k in range(steps)])
    assert all(lr == pytest.approx(0.2 / 2**0.5) for epoch, lr in whole.values() if epoch == 1)
    out = tmp_path / "stopped"
    run(out, "--max-steps", "2")
    assert run(out, "--resume", "auto", "--max-steps", "0") == whole


def test_speech_frame_accuracy_where_the_data_names_silence(
        tiny_data: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
        ) -> None:
    # The held-out file names classes 0 and 1 silence: every evaluation reports the accuracy
    # over the other frames too, counted once over all learners' shards.
    heldout = tmp_path / "heldout.h5"
    shutil.copy(tiny_data[1], heldout)
    mark_silence(heldout, [0, 1])
    with h5py.File(heldout, "r") as h5:
        speech = int(np.isin(h5["labels"][()], [0, 1], invert=True).sum())
    out = tmp_path / "run"
    capsys.readouterr()
    train_on_threads(_flags(tiny_data, out, "--max-steps", "4", "--batch-size", "8",
                            heldout=heldout), 2)
    said = capsys.readouterr().out
    evals = [m for m in read_metrics(out / "metrics.jsonl") if m["kind"] == "eval"]
    assert evals and all(e["speech_frames"] == speech for e in evals)
    assert all(0.0 <= e["heldout_speech_acc"] <= 1.0 for e in evals)
    assert f"on speech frames {evals[-1]['heldout_speech_acc']:.4f}" in said
    # Without the attribute (the training file): no speech figure, nothing else changes.
    plain = tmp_path / "plain"
    train_on_threads(_flags(tiny_data, plain, "--max-steps", "4", "--batch-size", "8"), 2)
    said = capsys.readouterr().out
    again = [m for m in read_metrics(plain / "metrics.jsonl") if m["kind"] == "eval"]
    assert "heldout_speech_acc" not in again[-1] and "on speech frames" not in said
    assert again[-1]["heldout_acc"] == evals[-1]["heldout_acc"]
