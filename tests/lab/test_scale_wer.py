"""lab.studies.scale_wer: configuration names, folds and paired differences (issue 46)."""

from __future__ import annotations

import json

import pytest

from lab.studies.scale_wer import config_name, fold_of, losses, losses_table, summarise
from lab.sweep.score import data_of, flag_value


def _row(algo: str, learners: int, fold: str, seed: int, wer: float | None,
         status: str = "ok", extra: str = "", **kw: object) -> dict:
    return {"algo": algo, "learners": learners, "global_batch": 4 * learners,
            "optimizer": "adam", "seed": seed, "status": status, "wer": wer, "steps": 100,
            "final_heldout_acc": 0.5,
            "extra": f"--train /d/sp{fold}/train.h5 --heldout /d/sp{fold}/heldout.h5 "
                     f"--keep-checkpoints 1 --log-every 50 {extra}".strip(), **kw}


def test_the_name_keeps_what_decides_the_result_and_drops_data_and_bookkeeping() -> None:
    row = _row("bmuf", 16, "A", 0, 10.0, extra="--bmuf-warmup-steps 25", beta1=0.5,
               sync_period=8, adam_moments="corrected")
    assert config_name(row) == "bmuf N16 B64 adam b1=0.5 tau8 corrected bmuf-warmup-steps 25"
    assert fold_of(row) == "spA"
    assert flag_value(["--a", "1", "--a=2"], "--a") == "2"
    assert data_of(["--train", "t", "--heldout", "h"]) == ("h", "t")
    assert data_of(["--train", "t"]) is None


def test_paired_differences_use_only_the_pairs_both_have_and_divergence_is_100() -> None:
    rows = [_row("ssgd", 1, "A", 0, 10.0), _row("ssgd", 1, "C", 0, 20.0),
            _row("bmuf", 16, "A", 0, 13.0), _row("bmuf", 16, "C", 0, 21.0),
            _row("bmuf", 16, "D", 0, 50.0),  # no single-learner run on D: not paired
            _row("ssgd", 16, "A", 0, None, status="diverged")]
    by = {e["config"]: e for e in summarise(rows, reference="ssgd N1 ")}
    bmuf, single, ssgd = by["bmuf N16 B64 adam"], by["ssgd N1 B4 adam"], by["ssgd N16 B64 adam"]
    assert bmuf["paired_delta"] == pytest.approx(((13 - 10) + (21 - 20)) / 2)
    assert bmuf["pairs"] == 2 and bmuf["mean"] == pytest.approx((13 + 21 + 50) / 3)
    assert single["paired_delta"] is None and single["mean"] == pytest.approx(15.0)
    assert ssgd["runs"] == {"spA/s0": 100.0} and ssgd["paired_delta"] == pytest.approx(90.0)


def test_losses_tell_under_training_from_the_runs_curves_and_logs(tmp_path) -> None:
    # Two runs of one configuration: the mean held-out loss after epoch 1, the mean of each
    # run's best, the mean of each run's last logged training loss; a diverged run is left out.
    logs = []
    for i, last in enumerate((0.3, 0.1)):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in [
            {"kind": "eval", "step": 0, "heldout_loss": 3.0},
            {"kind": "train", "step": 50, "loss": 2.0},
            {"kind": "train", "step": 100, "loss": last}]) + "\n")
        logs.append(str(run))
    rows = [_row("bmuf", 16, "A", 0, 10.0, heldout_loss_curve=[2.0, 1.5, 1.6], out_dir=logs[0]),
            _row("bmuf", 16, "C", 0, 12.0, heldout_loss_curve=[1.0, 0.9, 1.2], out_dir=logs[1]),
            _row("bmuf", 16, "D", 0, None, status="diverged", heldout_loss_curve=[9.0])]
    (entry,) = losses(rows)
    assert entry["runs"] == 2
    assert entry["first_epoch"] == pytest.approx(1.5) and entry["best"] == pytest.approx(1.2)
    assert entry["last_train"] == pytest.approx(0.2)
    assert "| bmuf N16 B64 adam | 2 | 1.50 | 1.20 | 0.20 |" in losses_table([entry])
