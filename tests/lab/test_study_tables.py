"""The study tables: baseline lookup, labels, the 2 % rule and 'largest batch within'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.studies import tables
from lab.studies.tables import StudyError, algo_label, study_a, study_b


def _row(i: str, algo: str, learners: int, batch: int, loss: float | None, *,
         status: str = "ok", **kw: object) -> dict:
    return {"id": i, "algo": algo, "learners": learners, "global_batch": batch,
            "status": status, "final_heldout_loss": loss,
            "final_frame_error": None if loss is None else loss / 4, "wall_s": 10.0, **kw}


BASE = _row("base", "ssgd", 1, 16, 1.0)


def test_labels_name_the_hierarchy() -> None:
    assert algo_label(_row("a", "adpsgd", 16, 256, 1, super_learner_size=4)) == \
        "H-ADPSGD (4 x 4)"
    assert algo_label(_row("a", "adpsgd", 16, 256, 1, super_learner_size=1)) == \
        "ADPSGD (16 x 1)"
    assert algo_label(_row("a", "ssgd", 16, 256, 1)) == "SSGD"
    assert algo_label(BASE) == "baseline (1 learner)"


def test_largest_batch_stops_at_the_first_miss() -> None:
    rows = [BASE,
            _row("s1", "ssgd", 16, 256, 1.019),       # within 2 %
            _row("s2", "ssgd", 16, 512, 1.021),       # just outside
            _row("s3", "ssgd", 16, 1024, 1.0),        # within, but after a miss
            _row("a1", "adpsgd", 16, 256, 1.0, super_learner_size=1),
            _row("a2", "adpsgd", 16, 512, None, status="failed", super_learner_size=1),
            _row("h1", "adpsgd", 16, 256, 1.05, super_learner_size=4)]
    res = study_b(rows, tolerance=0.02)
    assert res["limit"] == pytest.approx(1.02)
    assert res["batches"] == [256, 512, 1024]
    assert res["largest_within"] == {"SSGD": 256, "ADPSGD (16 x 1)": 256,
                                     "H-ADPSGD (4 x 4)": None}
    assert res["table"]["SSGD"]["1024"]["holds"] is True
    md = tables.markdown_b(res)
    assert "| SSGD | 1.0190 (+1.900%) ✓ | 1.0210 (+2.100%) ✗ | 1.0000 (+0.000%) ✓ | 256 |" in md
    assert "| ADPSGD (16 x 1) | 1.0000 (+0.000%) ✓ | failed |  | 256 |" in md
    assert "| H-ADPSGD (4 x 4) | 1.0500 (+5.000%) ✗ |  |  | none |" in md


def test_study_a_relative_to_baseline() -> None:
    base = _row("base", "ssgd", 1, 8, 2.0)
    rows = [base,
            _row("c", "bmuf", 16, 128, 2.2, adam_moments="corrected", beta1=0.9, sync_period=8),
            _row("v", "bmuf", 16, 128, None, status="timeout", adam_moments="average",
                 beta1=0.9, sync_period=8)]
    res = study_a(rows)
    by = {r["id"]: r for r in res["rows"]}
    assert by["c"]["loss_vs_baseline"] == pytest.approx(0.1)
    assert by["c"]["error_vs_baseline"] == pytest.approx(0.1)
    assert by["v"]["heldout_loss"] is None
    md = tables.markdown_a(res)
    assert "| corrected | 16 | 0.9 | 2.2000 | 0.5500 | +10.0% | +10.0% | 10 |" in md
    assert "(timeout)" in md


def test_missing_baseline_is_named() -> None:
    with pytest.raises(StudyError, match="--learners 1"):
        study_b([_row("s1", "ssgd", 16, 256, 1.0)])


def test_cli_reads_a_sweep_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [BASE, _row("s1", "ssgd", 16, 256, 1.01)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "b.json"
    assert tables.main(["b", str(tmp_path), "--json", str(out)]) == 0
    assert "| SSGD | 1.0100 (+1.000%) ✓ | 256 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["largest_within"] == {"SSGD": 256}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "results.jsonl").write_text(json.dumps(_row("s1", "ssgd", 16, 256, 1.0)) + "\n")
    assert tables.main(["b", str(empty)]) == 2
    assert "--learners 1" in capsys.readouterr().err
