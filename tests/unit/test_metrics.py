from hadpsgd.train.metrics import MetricsWriter, read_metrics


def test_jsonl_records_and_disabled_rank(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True)
    w.write("train", 10, loss=1.5, lr=0.1)
    w.write("eval", 20, heldout_loss=1.2)
    w.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in recs] == [("train", 10), ("eval", 20)]
    assert recs[0]["loss"] == 1.5 and "time" in recs[0]
    other = tmp_path / "other"
    other.mkdir()
    w = MetricsWriter(other, enabled=False)
    w.write("train", 1, loss=0.0)
    w.close()
    assert not (other / "metrics.jsonl").exists()


def test_tensorboard_events(tmp_path):
    import pytest

    pytest.importorskip("tensorboard")
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    w.write("train", 1, loss=2.0)
    w.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
