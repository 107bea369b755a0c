"""The GPU grid's cells, ratios, targets, tables and record, with fake numbers (no GPU)."""

import json

import pytest

from benchmarks.training import gpu_grid_report as rep
from benchmarks.training.gpu_grid import parse_args, status_of


def _side(fps: float, batch: int = 128) -> dict:
    return {"frames_per_s": fps, "sec_per_step": batch * 21 / fps, "windows": 4}


def test_cells_run_largest_batch_and_bf16_first():
    cells = rep.grid([16, 128, 64], ["fp32", "fp16", "tf32", "bf16"], ["per-layer", "stacked"])
    assert len(cells) == 24
    assert [c.key for c in cells[:3]] == ["128/bf16/stacked", "128/bf16/per-layer",
                                           "128/fp32/stacked"]
    assert cells[-1].key == "16/fp16/per-layer"
    assert [c.batch for c in cells[::8]] == [128, 64, 16]


def test_a_cell_gives_hadpsgd_run_its_flags():
    tf32 = rep.parse_key("64/tf32/per-layer")
    assert tf32.amp == "fp32" and tf32.tf32
    assert tf32.run_args() == ["--batch-size", "64", "--precision", "fp32", "--lstm-layout",
                               "per-layer", "--tf32"]
    bf16 = rep.parse_key("128/bf16/stacked")
    assert not bf16.tf32 and "--tf32" not in bf16.run_args() and bf16.amp == "bf16"
    for bad in ("128/bf16", "x/bf16/stacked", "128/fp64/stacked", "128/bf16/flat"):
        with pytest.raises(ValueError):
            rep.parse_key(bad)


def test_ratio_is_hadpsgd_over_plain_of_the_same_cell():
    cell = rep.parse_key("128/bf16/stacked")
    r = rep.row(cell, _side(48_000), _side(50_000))
    assert r["ratio"] == pytest.approx(0.96)
    assert r["vs_v100"] == pytest.approx(48_000 / 15_800)
    assert r["tf32"] is False and r["autocast"] == "bf16" and r["status"] == "ok"
    missing = rep.row(cell, {"exit": 1}, _side(50_000), "hadpsgd exit 1")
    assert missing["ratio"] is None and missing["vs_v100"] is None


def test_targets_at_batch_128():
    rows = [rep.row(rep.parse_key("128/bf16/stacked"), _side(50_000), _side(51_000)),
            rep.row(rep.parse_key("128/bf16/per-layer"), _side(40_000), _side(45_000)),
            rep.row(rep.parse_key("128/fp32/stacked"), None, _side(20_000), "over budget"),
            rep.row(rep.parse_key("64/bf16/stacked"), _side(30_000), _side(60_000))]
    goals = rep.targets(rows)
    speed = [g for g in goals if g["target"].startswith("bf16")]
    assert [(g["cell"], g["met"]) for g in speed] == [("128/bf16/stacked", True),
                                                      ("128/bf16/per-layer", False)]
    assert speed[0]["goal"] == pytest.approx(3 * 15_800)
    ratio = {g["cell"]: g["met"] for g in goals if g["target"].startswith("hadpsgd")}
    assert ratio == {"128/bf16/stacked": True, "128/bf16/per-layer": False,
                     "128/fp32/stacked": None}  # 64 is not a target batch
    lines = rep.target_table(goals)
    assert "| bf16 frames/s >= 3 x V100 (47,400) | 128/bf16/stacked | 50,000 | 47,400 | yes |" \
        in lines
    assert "| hadpsgd / plain >= 0.95 | 128/bf16/per-layer | 0.89 | 0.95 | **no** |" in lines
    assert "| hadpsgd / plain >= 0.95 | 128/fp32/stacked | - | 0.95 | not measured |" in lines


def test_table_rows_name_batch_precision_tf32_and_layout():
    rows = [rep.row(rep.parse_key("16/tf32/per-layer"), _side(9_000, 16), _side(10_000, 16)),
            rep.row(rep.parse_key("16/fp16/stacked"), None, None, "over budget")]
    lines = rep.table(rows)
    assert lines[0].startswith("| batch | precision | TF32 | LSTM | hadpsgd frames/s |")
    assert lines[2] == ("| 16 | fp32 | on | per-layer | 9,000 | 10,000 | 0.90 | 37.3 | 33.6 | "
                        "0.57 | ok |")
    assert lines[3] == "| 16 | fp16 | off | stacked | - | - | - | - | - | - | over budget |"


def test_record_is_json_with_summary_and_targets():
    rows = [rep.row(rep.parse_key("128/bf16/stacked"), _side(50_000), _side(50_000))]
    meta = {"time": "t", "device": {"name": "H100"}, "options": {}, "total_s": 1.0}
    rec = rep.record(rows, meta, {"forward": None})
    assert rec["benchmark"] == "gpu_grid" and rec["summary"] == {"128/bf16/stacked": 1.0}
    assert rec["targets"][0]["met"] is True
    json.dumps(rec)  # serialisable as it is


def _trace() -> dict:
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#11", "ts": 0, "dur": 100},
          {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#12", "ts": 100,
           "dur": 100},
          {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#11", "ts": 0,
           "dur": 999},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 50},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 120, "dur": 50},
          {"ph": "X", "cat": "kernel", "name": "lstm", "ts": 40, "dur": 40},  # overlaps gemm
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 180, "dur": 20},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 10},
          {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1}]
    return {"traceEvents": ev}


def test_trace_summary_ranks_kernels_and_measures_the_gpu_idle():
    s = rep.summarise_trace(_trace(), top=5)
    assert s["steps"] == 2 and s["span_ms"] == pytest.approx(0.2)
    assert s["kernel_ms"] == pytest.approx(0.14) and s["memcpy_ms"] == pytest.approx(0.02)
    assert s["gpu_busy_ms"] == pytest.approx(0.14)  # 10-80, 120-170, 180-200
    assert s["gpu_busy_frac"] == pytest.approx(0.7)
    assert [(k["name"], k["calls"]) for k in s["top"]] == [("gemm", 2), ("lstm", 1)]
    assert s["top"][0]["share"] == pytest.approx(100 / 140)
    lines = rep.profile_lines("hadpsgd", s, "t.json")
    assert "| `gemm` | 2 | 0.10 | 71% |" in lines
    assert rep.summarise_trace({})["gpu_busy_frac"] is None
    assert rep.profile_lines("plain", None, "-")[-2] == "not profiled"


def test_markdown_report_holds_every_part():
    rows = [rep.row(rep.parse_key("128/bf16/stacked"), _side(50_000), _side(50_000))]
    meta = {"time": "t", "total_s": 300.0, "options": {
        "preset": "swb", "classes": 32000, "device": "cuda", "steps": 40, "log_every": 8,
        "budget": 480.0}, "device": {
        "name": "H100", "torch": "2.11", "cuda": "13.0", "cudnn": 91900,
        "tf32_matmul_default": False, "tf32_cudnn_default": True}}
    fwd = {"preset": "small", "precision": "fp32", "frames": 20_000, "classes": 64,
           "max_abs_diff": 1.5e-4, "mean_abs_diff": 1e-6, "argmax_agree": 1.0,
           "same_offsets": True, "cuda": {"exit": 0, "wall_s": 9.0, "frames": 20_000,
                                          "forward_s": 0.5},
           "cpu": {"exit": 0, "wall_s": 12.0, "frames": 20_000, "forward_s": 4.0}}
    profile = {"cell": "128/bf16/stacked",
               "hadpsgd": {"trace": "h.json", "summary": rep.summarise_trace(_trace())},
               "plain": {"trace": "p.json", "summary": None}}
    rec = rep.record(rows, meta, {"profile": profile, "forward": fwd,
                                  "logs": {"128/fp32/stacked": "Traceback"}})
    text = rep.markdown(rec)
    for part in ("## Cells", "## Targets", "15,800 frames/s", "## Profile of 128/bf16/stacked",
                 "| `gemm` |", "not profiled", "| cuda | 0 | 9.0 | 0.50 | 40,000 |",
                 "Largest |cuda - cpu| of the log-posteriors: 0.00015",
                 "## Output of 128/fp32/stacked (failed)"):
        assert part in text, part


def test_status_names_what_a_cell_is_missing():
    assert status_of({"exit": 0, "frames_per_s": 1.0}, {"frames_per_s": 2.0}) == "ok"
    assert status_of({"exit": 3}, {"frames_per_s": 2.0}) == "hadpsgd exit 3"
    assert status_of({"exit": 0}, None) == "hadpsgd: no steady window; plain: not measured"
    assert status_of({"exit": 0, "frames_per_s": 1.0}, {"error": "OutOfMemoryError: x"}) == \
        "plain: OutOfMemoryError: x"


def test_command_line_checks():
    a = parse_args([])
    assert a.batch == [16, 64, 128] and a.precision == ["bf16", "fp32", "tf32"]
    assert a.layout == ["stacked", "per-layer"] and a.profile_cell == "128/bf16/stacked"
    with pytest.raises(SystemExit):
        parse_args(["--steps", "8", "--log-every", "8"])  # no steady window
    with pytest.raises(SystemExit):
        parse_args(["--profile-cell", "128/bf16"])


def test_without_cuda_the_grid_stops_with_exit_2(capsys):
    import torch

    from benchmarks.training.gpu_grid import main

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main([]) == 2
    assert "gpu_grid: needs a CUDA GPU" in capsys.readouterr().err


def test_the_default_grid_fits_its_budget_and_the_dry_run_says_so(capsys):
    """The default grid's estimate (H200 times of 2026-11-27) fits the default budget with a
    margin; the dry run prints every cell and the total without a GPU, and a grid that does not
    fit exits 1 before anything runs."""
    from benchmarks.training import gpu_grid_report as rep
    from benchmarks.training.gpu_grid import main

    a = parse_args([])
    cells = rep.grid(a.batch, a.precision, a.layout)
    assert rep.estimate(len(cells)) <= 0.85 * a.budget
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(c.key in out for c in cells) and "fits" in out
    assert main(["--dry-run", "--precision", "fp32", "tf32", "bf16", "fp16"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_run_flags_reach_every_hadpsgd_run_of_the_grid(tmp_path):
    """``--run-flags '--num-workers 0'``: the loader in the training process, the default of
    before, beside today's default in the same run (issue 44: show the workers in the grid)."""
    from pathlib import Path

    from benchmarks.training.gpu_grid import Grid

    a = parse_args(["--run-flags", "--num-workers 0", "--device", "cpu"])
    args = Grid(a, tmp_path).run_args((Path("t.h5"), Path("h.h5")), tmp_path / "o", 8)
    assert args[-2:] == ["--num-workers", "0"]
    assert Grid(parse_args(["--device", "cpu"]), tmp_path).run_args(
        (Path("t.h5"), Path("h.h5")), tmp_path / "o", 8)[-1] == "--overwrite"
