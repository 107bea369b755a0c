"""``python -m hadpsgd.plot RUN_DIR``: a run's curves from a synthetic ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hadpsgd.plot import curves_of
from hadpsgd.plot.__main__ import main

RECORDS = [
    {"kind": "eval", "step": 0, "epoch": 0, "heldout_loss": 3.8, "heldout_acc": 0.05},
    {"kind": "train", "step": 10, "loss": 3.0},
    {"kind": "eval", "step": 20, "epoch": 0, "heldout_loss": 2.0, "heldout_acc": 0.5},
    {"kind": "train", "step": 30, "loss": 1.9},  # trained again after the resume below
    {"kind": "resume", "step": 20},
    {"kind": "train", "step": 30, "loss": 1.8},
    {"kind": "failure", "step": 30, "learners": 3},
    {"kind": "train", "step": 40, "loss": 1.5},
    {"kind": "eval", "step": 40, "epoch": 1, "heldout_loss": 1.0, "heldout_acc": 0.8,
     "heldout_speech_acc": 0.7},
]


def _run(tmp_path: Path, records: list[dict]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_curves_keep_the_second_telling_after_a_resume_and_mark_events():
    curves = curves_of(RECORDS)
    assert curves.train_loss == ([10, 30, 40], [3.0, 1.8, 1.5])
    assert curves.heldout_loss == ([0, 20, 40], [3.8, 2.0, 1.0])
    assert curves.heldout_acc == ([0, 20, 40], [0.05, 0.5, 0.8])
    assert curves.speech_acc == ([40], [0.7])
    assert [(e.kind, e.step, e.note) for e in curves.events] == [
        ("resume", 20, ""), ("failure", 30, "3 learners")]


def test_plot_writes_the_png_and_prints_its_path(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _run(tmp_path, RECORDS)
    assert main([str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "plot.png")
    assert (run / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(run), "--out", str(tmp_path / "x" / "f.png")]) == 0
    assert (tmp_path / "x" / "f.png").is_file()


@pytest.mark.parametrize(("records", "says"), [
    (None, "has no metrics.jsonl"),
    ([{"kind": "resume", "step": 0}], "no training or held-out record yet"),
])
def test_a_directory_without_records_says_so(tmp_path, capsys, records, says):
    run = _run(tmp_path, records) if records is not None else tmp_path
    assert main([str(run)]) == 2
    assert says in capsys.readouterr().err and not (run / "plot.png").exists()


def test_lab_plots_given_a_run_directory_draws_the_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from lab.sweep.plots import main as lab_main

    run = _run(tmp_path, RECORDS)
    assert lab_main([str(run)]) == 0
    seen = capsys.readouterr()
    assert "is a run directory" in seen.err and "python -m hadpsgd.plot" in seen.err
    assert (run / "plot.png").is_file() and not (run / "plots").exists()


def test_several_runs_are_compared_by_step_bytes_and_time(tmp_path, capsys):
    # Issue 60: a slow-link user compares runs by the bytes they sent between nodes.
    from hadpsgd.plot import plot_runs
    from hadpsgd.train.metrics import read_metrics

    def run(name: str, per_step: float) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"train": {"algo": name},
                                                   "world": {"size": 4}}))
        recs = [{"kind": "eval", "step": 0, "time": 100.0, "heldout_loss": 4.0}]
        for step in (10, 20, 30, 40):
            recs.append({"kind": "train", "step": step, "time": 100.0 + step, "loss": 3.0,
                         "internode_bytes": per_step * step})
            if step % 20 == 0:
                recs.append({"kind": "eval", "step": step, "time": 100.5 + step,
                             "heldout_loss": 4.0 - step / 20})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return d

    ssgd, bmuf = run("ssgd", 1e6), run("bmuf", 1e3)
    curves = curves_of(read_metrics(bmuf / "metrics.jsonl"))
    # each held-out loss at the bytes sent by its step; step 0: nothing sent yet
    assert curves.loss_against_bytes() == ([0.0, 20e3, 40e3], [4.0, 3.0, 2.0])
    assert curves.seconds == ([10, 20, 30, 40], [10.0, 20.0, 30.0, 40.0])
    pytest.importorskip("matplotlib")
    out = plot_runs([ssgd, bmuf], tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(ssgd), str(bmuf), "--out", str(tmp_path / "d.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "d.png")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert main([str(ssgd), str(empty), "--out", str(tmp_path / "e.png")]) == 2
    assert "empty/metrics.jsonl has no training or held-out record" in capsys.readouterr().err


@pytest.mark.parametrize(("key", "kind", "counts", "marked"), [
    # BMUF's syncs of the whole model: a mark where the count grew since the last record.
    ("block_syncs", "block syncs", [0, 1, 1, 3], [20, 40]),
    # ADPSGD's exchanges start from 0 again after a resume: a new count is still a mark.
    ("gossip_rounds", "gossip rounds", [5, 9, 2, 2], [10, 20, 30]),
])
def test_block_syncs_and_gossip_rounds_are_marked_where_they_grew(tmp_path, key, kind, counts,
                                                                 marked):
    records = [{"kind": "train", "step": 10 * (i + 1), "loss": 1.0, key: c}
               for i, c in enumerate(counts)]
    curves = curves_of(records)
    assert curves.exchange_kind == kind
    assert curves.exchange_steps() == marked
    assert curves_of(RECORDS).exchange_steps() == [] and curves_of(RECORDS).exchange_kind == ""
    pytest.importorskip("matplotlib")
    run = _run(tmp_path, records)
    assert main([str(run)]) == 0 and (run / "plot.png").is_file()
