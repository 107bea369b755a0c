"""The CUDA-graph probe's plumbing on CPU: the eager step is timed, the graph says why not."""

import json

from benchmarks.training import graph_probe


def test_cpu_record_times_eager_and_names_the_graphs_need(tmp_path):
    out = tmp_path / "graph.json"
    assert graph_probe.main(["--preset", "small", "--classes", "12", "--feat-dim", "8",
                             "--batch", "2", "--window", "1", "--windows", "1",
                             "--device", "cpu", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    (row,) = record["results"]
    assert row["batch"] == 2 and row["frames"] == 2 * 21
    assert row["eager"]["frames_per_s"] > 0 and row["eager"]["ms_per_step"] > 0
    assert "need --device cuda" in row["graph"]["error"]
    assert "need --device cuda" in row["model_graph_staged"]["error"]
    # The eager backward's overlap: its first gradients (the output layer's) land before the
    # LSTM's backward, which is most of it; weighted by bytes less, the LSTM's (most of the
    # bytes) landing last (issue 59 item 3)
    eager = row["eager"]
    assert 0.3 < eager["overlap_window"] <= 1.0, eager
    assert 0.0 <= eager["overlap_bytes"] < eager["overlap_window"], eager
    assert record["meta"]["device"] == "cpu"
