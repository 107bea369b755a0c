"""The wire study's summary and table (lab/studies/wire_wer.py)."""

from __future__ import annotations

from lab.studies.wire_wer import summarise, table


def _row(config: str, seed: int, wer: float, per_frame: float, ratio: float) -> dict:
    return {"config": config, "seed": seed, "wer": wer, "bytes_per_frame": per_frame,
            "ratio_to_ssgd_fp32": ratio}


def test_means_and_ranges_per_configuration_most_bytes_first():
    rows = [_row("topk", 1, 6.0, 5.0, 1000.0), _row("ssgd", 0, 4.0, 5000.0, 1.0),
            _row("topk", 0, 4.0, 5.0, 1000.0), _row("ssgd", 1, 5.0, 5000.0, 1.0)]
    got = summarise(rows)
    assert [e["config"] for e in got] == ["ssgd", "topk"]
    assert got[1]["wers"] == [4.0, 6.0]  # by seed
    assert (got[1]["mean"], got[1]["low"], got[1]["high"]) == (5.0, 4.0, 6.0)
    assert "| topk | 5 | 1,000.0x | 4.00 / 6.00 | 5.00 % |" in table(got)


def test_bytes_are_means_over_seeds_and_compared_with_a_reference():
    # asynchronous gossip sends a little more or less with each run's timing
    rows = [_row("adpsgd-fp32", 0, 4.0, 4000.0, 1.5), _row("adpsgd-fp32", 1, 4.0, 3800.0, 1.6),
            _row("choco", 0, 3.0, 30.0, 200.0), _row("choco", 1, 5.0, 10.0, 600.0)]
    got = summarise(rows, reference="adpsgd-fp32")
    assert got[1]["bytes_per_frame"] == 20.0 and got[1]["ratio"] == 400.0
    assert got[1]["ref_ratio"] == 3900.0 / 20.0 and got[0]["ref_ratio"] == 1.0
    text = table(got, reference="adpsgd-fp32")
    assert "| vs adpsgd-fp32 |" in text and "| choco | 20 | 400.0x | 195.0x | 3.00 / 5.00 |" in text
    assert "vs adpsgd-fp32" not in table(summarise(rows))  # SSGD is the default reference


def test_a_study_record_becomes_rows_against_its_own_ssgd():
    from lab.studies.wire_wer import study_rows

    results = [
        {"config": "ssgd", "workers": 16, "seed": 0, "status": "ok", "wer": 70.0,
         "internode_bytes": 4000.0},
        {"config": "ssgd", "workers": 16, "seed": 1, "status": "ok", "wer": 68.0,
         "internode_bytes": 4000.0},
        {"config": "sign", "workers": 16, "seed": 0, "status": "ok", "wer": 69.123,
         "internode_bytes": 40.0},
        {"config": "sign", "workers": 16, "seed": 1, "status": "train exit 4", "wer": None,
         "internode_bytes": 40.0},  # a run that did not finish is no point
        {"config": "sign", "workers": 4, "seed": 0, "status": "ok", "wer": 60.0,
         "internode_bytes": 10.0},  # another worker count
        {"config": "other", "workers": 16, "seed": 0, "status": "ok", "wer": 1.0,
         "internode_bytes": 1.0}]  # not asked for
    rows = study_rows(results, 16, ["ssgd", "sign"])
    assert [(r["config"], r["seed"]) for r in rows] == [("ssgd", 0), ("ssgd", 1), ("sign", 0)]
    assert rows[2]["ratio_to_ssgd_fp32"] == 100.0 and rows[2]["wer"] == 69.12
    got = summarise(rows)
    assert [e["config"] for e in got] == ["ssgd", "sign"] and got[0]["mean"] == 69.0
