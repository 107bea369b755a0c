"""Checkpoint averaging (--avg, --avg-best): the mean of the weights, the choice, the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hadpsgd.forward import ForwardError
from hadpsgd.forward.__main__ import parser
from hadpsgd.forward.average import load_averaged
from hadpsgd.forward.model import describe
from hadpsgd.models import build_model
from hadpsgd.train.best import SCORE_KEY
from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint


def save(run: Path, step: int, seed: int, preset: str = "tiny", classes: int = 12,
         train: Path | None = None, loss: float | None = None) -> dict[str, torch.Tensor]:
    """Write checkpoint ``step`` of a BLSTM with random weights into ``run``; its weights.

    ``loss``: the held-out loss its manifest records (as training writes it after an
    evaluation of its step).
    """
    torch.manual_seed(seed)
    model = build_model(preset, 20, classes)
    config = {"data": {"train": str(train) if train else None, "chunk_len": 21},
              "model": {"preset": preset, "lstm_layout": "auto"},
              "train": {"precision": "fp32"}}
    state = {"model": model.state_dict(), "config": config,
             "progress": {"epoch": 0, "step_in_epoch": 0, "global_step": step}}
    meta: dict = {"step": step}
    if loss is not None:
        meta[SCORE_KEY] = {"loss": loss, "accuracy": 0.5, "frames": 100}
    save_checkpoint(state, checkpoint_path(run / "checkpoints", step), meta=meta)
    return {k: v.clone() for k, v in model.state_dict().items()}


def evals(run: Path, losses: list[tuple[int, float]]) -> None:
    """The run's metrics.jsonl with one eval record per (step, held-out loss)."""
    with (run / "metrics.jsonl").open("w") as fh:
        for step, loss in losses:
            fh.write(json.dumps({"kind": "eval", "step": step, "time": 0.0,
                                 "heldout_loss": loss, "heldout_acc": 0.5}) + "\n")


def test_two_checkpoints_average_to_the_mean_of_their_weights(tmp_path: Path) -> None:
    a = save(tmp_path, 5, seed=0)
    b = save(tmp_path, 10, seed=1)
    loaded = load_averaged(tmp_path, newest=2)
    got = loaded.model.state_dict()
    assert got.keys() == a.keys()
    for name in a:
        torch.testing.assert_close(got[name], (a[name] + b[name]) / 2, rtol=0, atol=1e-7)
    assert loaded.averaged == (checkpoint_path(tmp_path / "checkpoints", 10),
                               checkpoint_path(tmp_path / "checkpoints", 5))
    assert "average of 2 checkpoints" in describe(loaded) and "newest 2" in describe(loaded)
    # --avg 1 is the newest checkpoint's own weights.
    own = load_averaged(tmp_path, newest=1).model.state_dict()
    assert all(torch.equal(own[k], b[k]) for k in b)


def test_avg_best_takes_the_lowest_heldout_losses_of_the_manifests(tmp_path: Path) -> None:
    weights = {step: save(tmp_path, step, seed=step, loss=loss)
               for step, loss in ((5, 2.0), (10, 0.5), (15, 1.0))}
    save(tmp_path, 20, seed=20)  # a --checkpoint-every checkpoint: never evaluated
    loaded = load_averaged(tmp_path, best=2)
    ckpts = tmp_path / "checkpoints"
    assert loaded.averaged == (checkpoint_path(ckpts, 10), checkpoint_path(ckpts, 15))
    assert loaded.selection == "best 2 by held-out loss: 0.5000, 1.0000"
    got = loaded.model.state_dict()
    for name, value in weights[10].items():
        torch.testing.assert_close(got[name], (value + weights[15][name]) / 2, rtol=0,
                                   atol=1e-7)
    with pytest.raises(ForwardError, match=r"has 3 complete checkpoints with a held-out loss.*"
                                           r"step-00000020 has no held-out evaluation.*"
                                           r"--avg-best 3 or fewer"):
        load_averaged(tmp_path, best=4)


def test_an_older_run_is_scored_by_its_metrics_records(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        save(tmp_path, step, seed=step)  # manifests without a score
    # Step 10's second record is the run's after a resume: the last record of a step counts.
    evals(tmp_path, [(5, 2.0), (10, 3.0), (15, 1.0), (10, 0.5)])
    loaded = load_averaged(tmp_path, best=2)
    assert [p.name for p in loaded.averaged] == ["step-00000010", "step-00000015"]


def test_a_broken_checkpoint_is_skipped_by_name_and_the_count_is_told(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        save(tmp_path, step, seed=step)
    broken = checkpoint_path(tmp_path / "checkpoints", 15)
    with open(broken / "state.pt", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\0" * 8)
    loaded = load_averaged(tmp_path, newest=2)
    assert [p.name for p in loaded.averaged] == ["step-00000010", "step-00000005"]
    assert any("step-00000015" in why and "checksum" in why for why in loaded.skipped)
    with pytest.raises(ForwardError, match=r"--avg 3: .* has 2 complete checkpoints .*"
                                           r"step-00000015.*checksum.*--avg 2 or fewer"):
        load_averaged(tmp_path, newest=3)


def test_a_checkpoint_dir_averages_it_and_the_older_ones(tmp_path: Path) -> None:
    a, b = save(tmp_path, 5, seed=0), save(tmp_path, 10, seed=1)
    save(tmp_path, 15, seed=2)
    loaded = load_averaged(checkpoint_path(tmp_path / "checkpoints", 10), newest=2)
    got = loaded.model.state_dict()
    assert all(torch.allclose(got[k], (a[k] + b[k]) / 2, rtol=0, atol=1e-7) for k in a)


def test_another_architecture_is_refused_naming_the_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 5, seed=0, classes=7)
    save(tmp_path, 10, seed=1)
    with pytest.raises(ForwardError, match=r"cannot average .*step-00000005 .*: "
                                           r"its out.weight is \[7, 16\], not \[12, 16\]"):
        load_averaged(tmp_path, newest=2)
    save(tmp_path, 15, seed=2, preset="small")
    with pytest.raises(ForwardError, match=r"step-00000010 with .*step-00000015: it is a 'tiny' "
                                           r"BLSTM, not a 'small' one"):
        load_averaged(tmp_path, newest=2)


def test_avg_best_without_scores_and_both_flags_are_refused(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture
                                                              ) -> None:
    save(tmp_path, 5, seed=0)
    with pytest.raises(ForwardError, match=r"has 0 complete checkpoints with a held-out loss; "
                                           r"step-00000005 has no held-out evaluation .*"
                                           r"pass --avg N"):
        load_averaged(tmp_path, best=1)
    base = ["--model", "m", "--features", "f.h5", "--output", "o.h5"]
    for bad in (["--avg", "2", "--avg-best", "2"], ["--avg", "0"], ["--avg-best", "x"]):
        with pytest.raises(SystemExit) as exit_:
            parser().parse_args(base + bad)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument --avg" in err
    assert "must be a whole number >= 1, got '0'" in err
