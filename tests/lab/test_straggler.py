"""The straggler benchmark's arithmetic and the emulated device step it relies on."""

import json

import pytest

from benchmarks.training.straggler import ideal, train_seconds
from hadpsgd.env import EnvError, emulated_step_s


def test_ideal_speedup_counts_only_the_straggler_missing_work():
    assert ideal(4, 1) == pytest.approx(1.0)
    assert ideal(4, 2) == pytest.approx(1.75)  # 4 flat learners, one at half speed
    assert ideal(4, 3) == pytest.approx(2.5)
    assert ideal(2, 2) == pytest.approx(1.5)  # 2 super-learners, the straggler's at half


def test_train_seconds_spans_first_to_last_evaluation(tmp_path):
    lines = [{"kind": "eval", "step": 0, "time": 0.5},  # before training: not counted
             {"kind": "train", "time": 1.0}, {"kind": "eval", "time": 2.0},
             {"kind": "train", "time": 3.0}, {"kind": "eval", "time": 7.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert train_seconds(path) == pytest.approx(5.5)


def test_emulated_step(monkeypatch):
    monkeypatch.delenv("HADPSGD_EMULATE_STEP", raising=False)
    assert emulated_step_s(0) == 0.0
    monkeypatch.setenv("HADPSGD_EMULATE_STEP", "ms=40,rank=1,factor=2")
    assert emulated_step_s(0) == pytest.approx(0.04)
    assert emulated_step_s(1) == pytest.approx(0.08)
    for bad in ("40", "ms=x", "ms=-1", "ms=5,slow=1", "ms=5,factor=0"):
        monkeypatch.setenv("HADPSGD_EMULATE_STEP", bad)
        with pytest.raises(EnvError, match="HADPSGD_EMULATE_STEP"):
            emulated_step_s(0)
