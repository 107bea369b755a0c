import pytest

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


def test_plain_log_lines_where_there_is_no_bar(tmp_path, capsys, monkeypatch):
    """A batch log (no terminal) gets plain lines, throttled; no carriage-return bar."""
    from hadpsgd.train import progress as prog

    class Algo:
        skipped_steps = 0

        def metrics(self) -> dict:
            return {}

    writer = MetricsWriter(tmp_path, enabled=True)
    p = prog.Progress(Algo(), writer, frames_per_step=100, total=50, initial=10,
                      desc="epoch 0", bar=False, lines=True)
    for step in (11, 12):
        p.step()
        p.log(step, 0, 0.1, 1.5)
    out = capsys.readouterr().out
    assert out.count("[hadpsgd] epoch 0 step 11 (11/50 of the epoch): loss 1.5000") == 1
    assert "step 12" not in out and "\r" not in out  # within LINE_EVERY_S of the first
    monkeypatch.setattr(prog, "LINE_EVERY_S", 0.0)
    p.step()
    p.log(13, 0, 0.1, 1.25)
    assert "step 13 (13/50 of the epoch): loss 1.2500" in capsys.readouterr().out
    quiet = prog.Progress(Algo(), writer, 100, 50, 0, "epoch 0", bar=False, lines=False)
    quiet.step()
    quiet.log(1, 0, 0.1, 1.0)
    assert capsys.readouterr().out == ""
    writer.close()


def test_a_torn_last_record_is_cut_on_reopen_and_skipped_on_read(tmp_path):
    """A run killed mid-write leaves a last line without its newline: the reader leaves it
    out, and a resumed writer cuts it instead of gluing its first record onto it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "st')
    assert read_metrics(path) == [{"kind": "train", "step": 1}]
    writer = MetricsWriter(tmp_path)
    writer.resumed_at(1)
    writer.close()
    records = read_metrics(path)
    assert [r["kind"] for r in records] == ["train", "resume"], records
    path.write_text('{"kind": "train", "step": 1}\n{"bad\n{"kind": "eval", "step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)
