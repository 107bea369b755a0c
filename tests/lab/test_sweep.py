"""The sweep's grid, cell ids, command lines, resume logic and results table (no processes)."""

import csv
import json
from pathlib import Path

import pytest

from hadpsgd.exit_codes import EXIT_DIVERGED, EXIT_FAILED, EXIT_TIMED_OUT
from hadpsgd.launch import Launcher
from lab.sweep import cli as sweep
from lab.sweep.grid import Cell, GridError, GridSpec, expand, sbatch_script, unused_options
from lab.sweep.results import (
    RESULTS_CSV,
    RESULTS_JSONL,
    append_row,
    build_row,
    finished_ids,
    latest_rows,
    read_jsonl,
    summarize_metrics,
)

FAKE_LAUNCHER = Launcher("/opt/mpi/bin/mpirun", "openmpi")


def spec(**kw) -> GridSpec:
    base = dict(algos=["ssgd"], global_batches=[64], learners=[4], epochs=1, preset="tiny")
    base.update(kw)
    return GridSpec(**base)


# ---------------------------------------------------------------------------- grid
def test_brief_example_grid_counts():
    s = spec(algos=["ssgd", "adpsgd", "bmuf"], global_batches=[64, 256], learners=[4, 8],
             sync_periods=[8], beta1s=[0.9, 0.5], adam_moments=["corrected", "average"],
             super_learner_sizes=[1, 2], epochs=4, ranks_per_node=4)
    cells = expand(s)
    by_algo = {a: [c for c in cells if c.algo == a] for a in s.algos}
    # 2 batches x 2 learner counts = 4 base cells per algorithm;
    assert len(by_algo["ssgd"]) == 4  # nothing else applies to SGD SSGD
    assert len(by_algo["adpsgd"]) == 8  # x 2 super-learner sizes
    assert len(by_algo["bmuf"]) == 16  # adam (auto): x 2 beta1 x 2 moment strategies
    for c in by_algo["ssgd"]:
        assert (c.sync_period, c.beta1, c.adam_moments, c.super_learner_size) == (None,) * 4
        assert c.optimizer == "sgd"
    for c in by_algo["adpsgd"]:
        assert c.sync_period is None and c.beta1 is None and c.super_learner_size in (1, 2)
    for c in by_algo["bmuf"]:
        assert c.optimizer == "adam" and c.sync_period == 8 and c.super_learner_size is None
    assert {c.batch_size for c in cells if c.global_batch == 256 and c.learners == 8} == {32}
    assert len({c.id for c in cells}) == len(cells)


def test_beta1_multiplies_only_adam_cells():
    cells = expand(spec(algos=["ssgd"], optimizers=["sgd", "adam"], beta1s=[0.9, 0.5]))
    assert sorted((c.optimizer, c.beta1) for c in cells) == [
        ("adam", 0.5), ("adam", 0.9), ("sgd", None)]


def test_unused_options_are_reported_not_multiplied():
    s = spec(algos=["ssgd"], sync_periods=[8, 16], beta1s=[0.5])
    assert len(expand(s)) == 1
    notes = " ".join(unused_options(s))
    assert "--sync-period" in notes and "--beta1" in notes


def test_divisibility_error_names_the_cell():
    with pytest.raises(GridError, match=r"ssgd global batch 64 x 6 learners.*not divisible"):
        expand(spec(learners=[4, 6]))


def test_layout_errors_name_the_cell():
    with pytest.raises(GridError, match=r"6 learners.*--ranks-per-node 4"):
        expand(spec(global_batches=[48], learners=[6], ranks_per_node=4))
    with pytest.raises(GridError, match=r"adpsgd global batch 64 x 4 learners.*super-learners"):
        expand(spec(algos=["adpsgd"], super_learner_sizes=[3]))


def test_ranks_per_node_capped_at_learners():
    cells = expand(spec(learners=[2, 8], global_batches=[16], ranks_per_node=4))
    assert [(c.learners, c.ranks_per_node) for c in cells] == [(2, 2), (8, 4)]


def test_passthrough_may_not_override_sweep_options():
    with pytest.raises(GridError, match="--batch-size is set by the sweep"):
        expand(spec(extra=["--lr", "0.1", "--batch-size", "8"]))
    with pytest.raises(GridError, match="--out-dir"):
        expand(spec(extra=["--out-dir=/tmp/x"]))
    with pytest.raises(GridError, match="--algo"):
        expand(spec(algo_extra={"ssgd": ["--algo", "bmuf"]}))


def test_algo_args_only_reach_their_algorithm():
    cells = expand(spec(algos=["ssgd", "bmuf"], extra=["--lr", "0.1"],
                        algo_extra={"bmuf": ["--lr", "0.002"]}))
    extra = {c.algo: c.extra for c in cells}
    assert extra == {"ssgd": ("--lr", "0.1"), "bmuf": ("--lr", "0.1", "--lr", "0.002")}


# ---------------------------------------------------------------------------- ids
def test_cell_id_is_stable_and_readable():
    cell = Cell(algo="bmuf", global_batch=256, learners=8, batch_size=32, optimizer="adam",
                epochs=4, preset="tiny", beta1=0.5, sync_period=8, adam_moments="corrected",
                ranks_per_node=4)
    # Pinned values: a change to the hashing would orphan every existing sweep directory.
    assert cell.id == "bmuf-B256-L8-adam-b1_0.5-tau8-corrected-8ed68a42"
    plain = Cell(algo="ssgd", global_batch=64, learners=4, batch_size=16, optimizer="sgd",
                 epochs=1, preset="tiny")
    assert plain.id == "ssgd-B64-L4-sgd-1c6e4158"
    assert cell.id == Cell(**cell.params() | {"extra": ()}).id
    again = expand(spec(algos=["bmuf"], global_batches=[256], learners=[8], epochs=4,
                        beta1s=[0.5], sync_periods=[8], adam_moments=["corrected"],
                        ranks_per_node=4))
    assert [c.id for c in again] == [cell.id]


def test_cell_id_changes_with_any_parameter():
    base = expand(spec())[0]
    others = [expand(spec(epochs=2))[0], expand(spec(preset="small"))[0],
              expand(spec(extra=["--lr", "0.2"]))[0], expand(spec(seeds=[1]))[0],
              expand(spec(ranks_per_node=2))[0]]
    assert len({base.id, *(c.id for c in others)}) == 1 + len(others)


# ---------------------------------------------------------------------------- commands
def test_run_args():
    cell = expand(spec(algos=["bmuf"], global_batches=[16], learners=[2], beta1s=[0.5],
                       sync_periods=[4], ranks_per_node=1, extra=["--lr", "0.002"]))[0]
    args = cell.run_args("/s/cells/x")
    text = " ".join(args)
    for part in ("--algo bmuf", "--batch-size 8", "--epochs 1", "--preset tiny",
                 "--optimizer adam", "--beta1 0.5", "--sync-period 4", "--ranks-per-node 1",
                 "--no-progress", "--lr 0.002"):
        assert part in text
    assert args[-2:] == ["--out-dir", "/s/cells/x"]
    assert "--ranks-per-node" not in cell.run_args("/x", emulate_nodes=False)


SWEEP_ARGS = ["--algos", "ssgd", "--global-batch", "8,16", "--learners", "2", "--epochs", "1",
              "--preset", "tiny"]


@pytest.fixture
def fake_launcher(monkeypatch):
    monkeypatch.setattr(sweep, "find_launcher", lambda: FAKE_LAUNCHER)


def test_print_commands(tmp_path, capsys, fake_launcher):
    code = sweep.main(["--sweep-dir", str(tmp_path / "s"), *SWEEP_ARGS, "--print-commands",
                       "--", "--max-steps", "2"])
    assert code == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("/opt")]
    assert len(lines) == 2
    for line, batch in zip(lines, (4, 8), strict=True):
        assert line.startswith("/opt/mpi/bin/mpirun -np 2 --oversubscribe --bind-to none ")
        assert "-m hadpsgd.run --algo ssgd" in line and f"--batch-size {batch} " in line
        assert "--max-steps 2" in line and str(tmp_path / "s" / "cells") in line
    assert not (tmp_path / "s").exists()  # a dry run creates nothing


def test_sbatch_scripts(tmp_path, capsys):
    code = sweep.main(["--sweep-dir", str(tmp_path / "s"), *SWEEP_ARGS, "--sbatch",
                       "--sbatch-opt=--partition=gpu", "--timeout", "3600"])
    assert code == 0
    out = capsys.readouterr().out
    scripts = sorted((tmp_path / "s" / "sbatch").glob("*.sbatch"))
    assert len(scripts) == 2
    assert all(f"sbatch {s}" in out for s in scripts)
    text = scripts[0].read_text()
    for part in ("#SBATCH --ntasks=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --time=1:00:00",
                 "#SBATCH --partition=gpu", "srun --mpi=pmix python -m hadpsgd.run", "exit.json",
                 "#SBATCH --gpus-per-node=2", "#SBATCH --signal=USR1@120", "#SBATCH --requeue",
                 "--resume auto", 'if [ "$rc" -eq 75 ]', 'scontrol requeue "$SLURM_JOB_ID"'):
        assert part in text
    assert "B:USR1" not in text  # the batch shell alone would never tell the ranks
    assert "--ranks-per-node" not in text


def test_sbatch_script_node_size():
    cell = expand(spec(learners=[16], global_batches=[64], ranks_per_node=4))[0]
    text = sbatch_script(cell, "/shared/c", 90, gpus_per_node=8)
    assert "--ntasks-per-node=4" in text and "--time=0:02:00" in text
    cell = expand(spec(learners=[16], global_batches=[64]))[0]
    assert "--ntasks-per-node=8" in sbatch_script(cell, "/shared/c", 90, gpus_per_node=8)
    cpu = sbatch_script(cell, "/shared/c", 90, gpus_per_node=0)  # a CPU cluster
    assert "--ntasks-per-node=16" in cpu and "--gpus" not in cpu


# ---------------------------------------------------------------------------- resume
def _fake_run(calls):
    def run_cell(cell, sweep_dir, launcher, timeout):
        calls.append(cell.id)
        return {"id": cell.id, "status": "ok", "exit_code": 0, "algo": cell.algo,
                "final_heldout_loss": 1.0}
    return run_cell


def test_resume_skips_finished_cells(tmp_path, monkeypatch, capsys, fake_launcher):
    sweep_dir = tmp_path / "s"
    cells = expand(spec(global_batches=[8, 16], learners=[2]))
    append_row(sweep_dir, {"id": cells[0].id, "status": "ok", "final_heldout_loss": 2.0})
    calls: list[str] = []
    monkeypatch.setattr(sweep, "run_cell", _fake_run(calls))
    assert sweep.main(["--sweep-dir", str(sweep_dir), *SWEEP_ARGS]) == 0
    assert calls == [cells[1].id]
    out = capsys.readouterr().out
    assert f"{cells[0].id}: skipped" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["ran"], summary["skipped"], summary["finished"]) == (1, 1, 2)
    # Run again: everything is finished, nothing runs.
    calls.clear()
    assert sweep.main(["--sweep-dir", str(sweep_dir), *SWEEP_ARGS]) == 0
    assert calls == []
    assert json.loads((sweep_dir / "sweep.json").read_text())["cells"] == [c.id for c in cells]


def test_failed_cells_rerun_unless_told(tmp_path, monkeypatch, fake_launcher):
    sweep_dir = tmp_path / "s"
    cells = expand(spec(global_batches=[8, 16], learners=[2]))
    append_row(sweep_dir, {"id": cells[0].id, "status": "ok"})
    append_row(sweep_dir, {"id": cells[1].id, "status": "failed", "exit_code": 1})
    calls: list[str] = []
    monkeypatch.setattr(sweep, "run_cell", _fake_run(calls))
    assert sweep.main(["--sweep-dir", str(sweep_dir), *SWEEP_ARGS,
                       "--no-rerun-failed"]) == 0
    assert calls == []
    assert sweep.main(["--sweep-dir", str(sweep_dir), *SWEEP_ARGS]) == 0
    assert calls == [cells[1].id]
    assert finished_ids(sweep_dir) == {c.id for c in cells}  # the new row wins


def test_failed_run_is_recorded_and_sweep_goes_on(tmp_path, monkeypatch, capsys,
                                                  fake_launcher):
    def run_cell(cell, sweep_dir, launcher, timeout):
        ok = cell.global_batch == 16
        out = sweep.cell_dir(sweep_dir, cell)
        if ok:
            _write_metrics(out)
        return build_row(cell.id, cell.params(), out, 0 if ok else 3, 1.0,
                         log=Path("run.log"))
    monkeypatch.setattr(sweep, "run_cell", run_cell)
    assert sweep.main(["--sweep-dir", str(tmp_path), *SWEEP_ARGS]) == 1
    rows = latest_rows(tmp_path)
    assert sorted(r["status"] for r in rows.values()) == ["failed", "ok"]
    first = next(r for r in rows.values() if r["global_batch"] == 8)
    assert first["exit_code"] == 3 and "run.log" in first["error"]


# ---------------------------------------------------------------------------- results
METRICS = [
    {"kind": "train", "step": 2, "time": 1.0, "epoch": 0, "loss": 2.5, "frames_per_s": 1000.0},
    {"kind": "train", "step": 4, "time": 2.0, "epoch": 0, "loss": 2.4, "frames_per_s": 3000.0},
    {"kind": "eval", "step": 4, "time": 2.5, "epoch": 0, "heldout_loss": 2.3,
     "heldout_acc": 0.25, "frames": 100},
    {"kind": "train", "step": 6, "time": 3.0, "epoch": 1, "loss": 2.2, "frames_per_s": 2000.0},
    {"kind": "eval", "step": 8, "time": 4.0, "epoch": 1, "heldout_loss": 2.1,
     "heldout_acc": 0.4, "frames": 100},
]


def _write_metrics(directory: Path, records=METRICS, torn: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (directory / "metrics.jsonl").write_text(text + ('{"kind": "tra' if torn else ""))


def test_summarize_metrics():
    s = summarize_metrics(METRICS)
    assert s["eval_epochs"] == [0, 1]
    assert s["heldout_loss_curve"] == [2.3, 2.1]
    assert s["heldout_acc_curve"] == [0.25, 0.4]
    assert s["final_heldout_loss"] == 2.1 and s["final_heldout_acc"] == 0.4
    assert s["final_frame_error"] == pytest.approx(0.6)
    assert s["mean_frames_per_s"] == pytest.approx(2000.0)
    assert s["steps"] == 8
    empty = summarize_metrics([])
    assert empty["final_heldout_loss"] is None and empty["mean_frames_per_s"] is None


def test_build_row_statuses(tmp_path):
    cell = expand(spec())[0]
    out = tmp_path / "cell"
    _write_metrics(out, torn=True)  # a run killed mid-line leaves a torn last line
    assert len(read_jsonl(out / "metrics.jsonl")) == len(METRICS)
    row = build_row(cell.id, cell.params(), out, 0, 12.5, command="mpirun ...",
                    log=out / "run.log")
    assert row["status"] == "ok" and row["error"] is None
    assert row["algo"] == "ssgd" and row["global_batch"] == 64 and row["batch_size"] == 16
    assert row["heldout_loss_curve"] == [2.3, 2.1] and row["wall_s"] == 12.5
    assert build_row(cell.id, cell.params(), out, 1, 1.0)["status"] == "failed"
    timeout = build_row(cell.id, cell.params(), out, -15, 1.0, timed_out=True)
    assert timeout["status"] == "timeout"
    no_eval = tmp_path / "no_eval"
    _write_metrics(no_eval, METRICS[:2])
    row = build_row(cell.id, cell.params(), no_eval, 0, 1.0)
    assert row["status"] == "failed" and "no held-out" in row["error"]
    missing = build_row(cell.id, cell.params(), tmp_path / "nothing", 2, 1.0)
    assert missing["status"] == "failed" and missing["heldout_loss_curve"] == []


def test_diverged_run_is_a_finished_result(tmp_path):
    cell = expand(spec())[0]
    out = tmp_path / "cell"
    _write_metrics(out, METRICS[:2])  # it stopped before its first evaluation
    log = out / "run.log"
    # A finite divergence (--max-loss-ratio): exit 4 and no "non-finite" anywhere in the log.
    log.write_text("hadpsgd: rank 0: error: loss 45.3 past 10x its start at step 100\n")
    row = build_row(cell.id, cell.params(), out, EXIT_DIVERGED, 3.0, log=log)
    assert row["status"] == "diverged" and "--max-loss-ratio" in row["error"]
    assert row["exit_code"] == EXIT_DIVERGED and str(log) in row["error"]
    append_row(tmp_path, row)
    assert finished_ids(tmp_path) == {cell.id}  # a rerun skips it: it would diverge again


@pytest.mark.parametrize("code", [EXIT_FAILED, EXIT_TIMED_OUT, 137, None])
def test_status_follows_the_exit_code_not_the_log(tmp_path, code):
    cell = expand(spec())[0]
    out = tmp_path / "cell"
    log = out / "run.log"
    out.mkdir()
    log.write_text("hadpsgd: error: 9 non-finite loss/gradient events, more than "
                   "--max-nonfinite 5\n")  # the old divergence message, but not exit 4
    row = build_row(cell.id, cell.params(), out, code, 3.0, log=log)
    assert row["status"] == "failed" and str(log) in row["error"]
    append_row(tmp_path, row)
    assert finished_ids(tmp_path) == set()  # a rerun runs it again


def test_results_table_jsonl_and_csv(tmp_path):
    cell = expand(spec())[0]
    _write_metrics(tmp_path / "c")
    append_row(tmp_path, build_row(cell.id, cell.params(), tmp_path / "c", 1, 1.0))
    append_row(tmp_path, build_row(cell.id, cell.params(), tmp_path / "c", 0, 2.0))
    assert len(read_jsonl(tmp_path / RESULTS_JSONL)) == 2
    assert finished_ids(tmp_path) == {cell.id}
    with (tmp_path / RESULTS_CSV).open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 1  # the latest row per cell
    assert rows[0]["status"] == "ok" and json.loads(rows[0]["heldout_loss_curve"]) == [2.3, 2.1]
    assert rows[0]["beta1"] == "" and rows[0]["learners"] == "4"


def test_collect_sbatch_outputs(tmp_path, capsys):
    args = ["--sweep-dir", str(tmp_path), *SWEEP_ARGS]
    cells = expand(spec(global_batches=[8, 16], learners=[2]))
    done = sweep.cell_dir(tmp_path, cells[0])
    _write_metrics(done)
    (done / "exit.json").write_text('{"exit_code": 0, "wall_s": 42}')
    assert sweep.main([*args, "--collect"]) == 0
    rows = latest_rows(tmp_path)
    assert list(rows) == [cells[0].id] and rows[cells[0].id]["wall_s"] == 42
    assert "1 without exit.json" in capsys.readouterr().out
    assert sweep.main([*args, "--collect"]) == 0  # nothing new: no duplicate row
    assert len(read_jsonl(tmp_path / RESULTS_JSONL)) == 1


# ---------------------------------------------------------------------------- launching
_FLAKY_LAUNCHER = """
import sys
from pathlib import Path
tries = Path(sys.argv[1])
n = len(tries.read_text()) if tries.exists() else 0
tries.write_text("x" * (n + 1))
if n < int(sys.argv[2]):
    print("The PMIx server's listener thread failed to start")
    sys.exit(213)
sys.exit(int(sys.argv[3]))
"""


@pytest.mark.parametrize("start_failures, code, launches, recorded", [
    (1, 0, 2, 0),                      # the launcher failed once: started again, the run's exit
    (5, 0, 3, 213),                    # it never starts: given up after LAUNCH_TRIES
    (0, EXIT_FAILED, 1, EXIT_FAILED),  # the run itself failed: never started again
])
def test_a_cell_whose_launcher_failed_to_start_is_started_again(
        tmp_path, monkeypatch, start_failures, code, launches, recorded):
    import sys

    from lab.sweep import runner

    script, tries = tmp_path / "mpirun.py", tmp_path / "tries"
    script.write_text(_FLAKY_LAUNCHER)
    monkeypatch.setattr(runner, "local_command", lambda *a: [
        sys.executable, str(script), str(tries), str(start_failures), str(code)])
    cell = expand(spec())[0]
    row = runner.run_cell(cell, tmp_path / "sweep", FAKE_LAUNCHER, timeout=300)
    assert len(tries.read_text()) == launches
    assert row["exit_code"] == recorded
    # The stand-in writes no metrics, so even exit 0 is not "ok"; the error says which.
    assert ("exit code 0 but no held-out" in row["error"]) == (recorded == 0)


# ---------------------------------------------------------------------------- plots
def test_plots_survive_failed_and_partial_cells(tmp_path):
    pytest.importorskip("matplotlib")
    from lab.sweep.plots import make_plots, scaling_groups

    rows = []
    for algo in ("ssgd", "adpsgd"):
        for gb, n in ((8, 2), (16, 2), (16, 4)):
            rows.append({"id": f"{algo}-{gb}-{n}", "status": "ok", "algo": algo,
                         "global_batch": gb, "learners": n, "batch_size": gb // n,
                         "heldout_loss_curve": [2.0, None, 1.5], "eval_epochs": [0, 1, 2],
                         "final_frame_error": 0.5, "mean_frames_per_s": 100.0 * n})
    rows.append({"id": "bad", "status": "failed", "algo": "bmuf", "global_batch": 8,
                 "learners": 2, "exit_code": 1})
    rows.append({"id": "slow", "status": "timeout", "algo": "ssgd", "global_batch": 64,
                 "learners": 8})
    (tmp_path / RESULTS_JSONL).write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = make_plots(tmp_path)
    assert record["left_out"] == {"bad": "failed", "slow": "timeout"}
    assert record["drawn"] == 6
    for path in record["plots"].values():
        assert Path(path).read_bytes()[:4] == b"\x89PNG"
    # Weak scaling groups share the per-learner batch: 4 (B=8 on 2, B=16 on 4) and 8.
    groups = dict(scaling_groups([r for r in rows if r["status"] == "ok"]))
    assert [r["learners"] for r in groups["ssgd (batch_size=8)"]] == [2]
    assert [r["learners"] for r in groups["ssgd (batch_size=4)"]] == [2, 4]
    # An empty sweep still gives three (empty) plots.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(make_plots(empty)["plots"]) == 3


def test_legend_names_only_the_passthrough_options_that_differ():
    from lab.sweep.plots import extra_options, label

    assert extra_options("--train a.h5 --lr 0.1 --nesterov") == {
        "--train": "a.h5", "--lr": "0.1", "--nesterov": ""}
    rows = [{"extra": "--train a.h5 --lr 0.1 --bmuf-warmup-steps 14", "beta1": 0.9},
            {"extra": "--train a.h5 --lr 0.1 --bmuf-warmup-steps 7", "beta1": 0.5},
            {"extra": "--train a.h5 --lr 0.1", "beta1": 0.5}]
    assert label(rows[0], ["beta1", "extra"], rows) == "beta1=0.9, bmuf-warmup-steps=14"
    assert label(rows[2], ["extra"], rows) == "no bmuf-warmup-steps"


def test_baseline_is_drawn_in_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from lab.sweep.plots import _pyplot, plot_loss_curves

    class Spy:
        """pyplot, keeping the figures it makes (the plot closes them after saving)."""

        def __init__(self, plt):
            self.plt, self.figs = plt, []

        def subplots(self, *a, **kw):
            fig, axes = self.plt.subplots(*a, **kw)
            self.figs.append(fig)
            return fig, axes

        def __getattr__(self, name):
            return getattr(self.plt, name)

    curve = {"status": "ok", "heldout_loss_curve": [2.0, 1.5], "eval_epochs": [0, 1]}
    rows = [{"id": "base", "algo": "ssgd", "learners": 1, "global_batch": 16,
             "optimizer": "sgd", **curve},
            {"id": "s", "algo": "ssgd", "learners": 4, "global_batch": 64, **curve},
            {"id": "a", "algo": "adpsgd", "learners": 4, "global_batch": 64, **curve}]
    spy = Spy(_pyplot())
    plot_loss_curves(spy, rows, tmp_path / "loss.png")
    panels = [ax for ax in spy.figs[0].axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["ssgd", "adpsgd"]
    for ax in panels:
        labels = ax.get_legend_handles_labels()[1]
        assert labels == ["B=64", "baseline: 1 learner, B=16 (ssgd, sgd)"]


@pytest.mark.parametrize("bad, message", [
    (["--learners", "0"], "--learners values must be >= 1"),
    (["--optimizer", "rmsprop"], "--optimizer rmsprop"),
    (["--adam-moments", "mean"], "--adam-moments mean"),
    (["--beta1", "1.5"], "--beta1 values"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--algo-args", "bmuf=--lr 1"], "--algo-args names bmuf"),
])
def test_bad_options_exit_2(tmp_path, capsys, bad, message):
    with pytest.raises(SystemExit) as err:
        sweep.main(["--sweep-dir", str(tmp_path), *SWEEP_ARGS, *bad])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_grid_error_exit_2(tmp_path, capsys):
    assert sweep.main(["--sweep-dir", str(tmp_path), *SWEEP_ARGS, "--learners", "3"]) == 2
    assert "not divisible by 3 learners" in capsys.readouterr().err
