"""What the GPU check decides without a GPU: its budget, statuses, steady speed and report."""

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks.training.steady import Steady, read_steady, steady, steady_records

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _gpu_check as gc  # noqa: E402 - scripts/ is no package: found through sys.path
import _gpu_check_plan as gp  # noqa: E402

PART_3 = {"sversions", "sgraph", "gstack", "glayer", "snccl"}
"""The shared-GPU plan (issue 59): NCCL between ranks on one GPU, and the CUDA graphs' checks
that have never run (the capture beside a pinning thread, the overlap per stage)."""
PART_1 = {"machine", "nccl1", "nccl", "pytest", "ssgdn", "adpsgd", "hadpsgd", "bmuf",
          "swbbf16"}
"""What the default command must run: what proves the GPU (docs/gpu.md)."""


class _Recorder:
    """Stands in for ``gpu_check.Runner``: records what each check would run."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def machine(self) -> None:
        self.calls.append(("machine",))

    def python(self, name: str, code: str, timeout: float) -> None:
        self.calls.append(("python", name, code))

    def pytest(self, limit: float, paths: tuple = ("tests/gpu",), keyword: str | None = None,
               env: dict | None = None, name: str = "pytest tests/gpu") -> None:
        self.calls.append(("pytest", limit, tuple(paths), keyword, env or {}))

    def train(self, name: str, nprocs: int, args: list[str], steps: int, resume: bool = True,
              timeout: float = 150, **kw: object) -> None:
        self.calls.append(("train", name, nprocs, args, resume, kw.get("preset", "small")))

    def bench(self, name: str, cmd: list[str], *rest: object) -> None:
        self.calls.append(("bench", name, cmd))


def _plan(tmp_path: Path, gpus: int = 1) -> tuple[list, _Recorder]:
    rec = _Recorder()
    return gp.plan(rec, gpus, tmp_path, quick=False), rec


def _part(items: list, part: str) -> list:
    return [item for item in items if gp.chosen(item, part)]


def _train(step: int, fps: float, time: float, epoch: int = 0) -> dict:
    return {"kind": "train", "step": step, "time": time, "epoch": epoch, "frames_per_s": fps}


# ---------------------------------------------------------------------------- budget
def test_a_check_starts_only_with_the_time_it_needs_left():
    assert gc.start_limit(elapsed=100, budget=540, limit=150, need=35) == 150
    assert gc.start_limit(elapsed=450, budget=540, limit=150, need=35) == pytest.approx(90)
    assert gc.start_limit(elapsed=520, budget=540, limit=150, need=35) is None
    assert gc.start_limit(elapsed=600, budget=540, limit=150, need=0) is None


def test_a_command_ends_at_the_budget_and_says_so():
    assert gc.launch_limit(now=10, deadline=500, limit=150) == (150, False)
    assert gc.launch_limit(now=400, deadline=500, limit=150) == (100, True)
    assert gc.launch_limit(now=600, deadline=500, limit=150) == (1.0, True)  # never 0


def test_pytest_ends_each_test_before_the_run():
    whole, per_test = gc.pytest_limits(330)
    assert whole == 330 and per_test == gc.PER_TEST_MAX_S
    whole, per_test = gc.pytest_limits(150)
    assert whole == 150 and per_test == 130
    assert gc.pytest_limits(15)[1] == 10  # a floor, not a negative limit


# ---------------------------------------------------------------------------- statuses
def test_only_failures_and_budget_skips_fail_the_run():
    ok = [gc.Check("a", gc.PASS), gc.Check("b", "needs 2 GPUs"), gc.Check("c", gc.SKIPPED)]
    assert gc.exit_status(ok) == 0
    assert gc.exit_status([*ok, gc.Check("d", gc.OVER_BUDGET)]) == 1
    assert gc.exit_status([*ok, gc.Check("d", gc.FAIL)]) == 1


def test_a_skip_for_want_of_gpus_is_said_as_such():
    assert gc.skip_status("needs 2 GPUs") == "needs 2 GPUs"
    assert gc.skip_status("Skipped: needs 4 or more GPUs") == "needs 4 GPUs"
    assert gc.skip_status("needs root") == gc.SKIPPED


def test_counts_and_the_command_that_runs_what_the_budget_left_out():
    checks = [gc.Check("a", gc.PASS), gc.Check("b", "needs 2 GPUs"),
              gc.Check("swb", gc.OVER_BUDGET, key="swbs"),
              gc.Check("ttp", gc.OVER_BUDGET, key="ttp")]
    line = gc.counts_line(checks)
    assert "**0 failed**, 1 passed" in line
    assert "1 need more GPUs than this machine has (not a failure)" in line
    assert "2 not run for lack of budget (a failure)" in line
    assert gc.rerun_hint(checks, "r.md", 540) == \
        "bash scripts/gpu_check.sh r.md --only swbs,ttp --budget 540"
    assert gc.rerun_hint(checks[:2], "r.md", 540) is None


# ---------------------------------------------------------------------------- settings
def test_batch_precision_and_tf32_come_from_the_run_config_first():
    config = {"train": {"batch_size": 16}, "precision": {"precision": "bf16", "tf32": True}}
    assert gc.run_settings(config, []) == ("16", "bf16", "on")
    old = {"train": {"batch_size": 16, "precision": "bf16", "tf32": True}}  # before its section
    assert gc.run_settings(old, []) == ("16", "bf16", "on")
    args = ["--algo", "ssgd", "--batch-size", "16", "--precision=fp16", "--tf32"]
    assert gc.run_settings(None, args) == ("16", "fp16", "on")
    assert gc.run_settings(None, ["--algo", "ssgd"]) == ("32", "fp32", "off")


def test_junit_record_becomes_one_row_per_test():
    xml = """<testsuites><testsuite>
      <testcase name="test_ok" time="1.25"/>
      <testcase name="test_two"><skipped message="needs 2 GPUs"/></testcase>
      <testcase name="test_bad"><failure message="assert 1 == 2">trace</failure></testcase>
      <testcase name="test_err"><error message="boom"/></testcase>
    </testsuite></testsuites>"""
    rows = {c.name.split()[-1]: c for c in gc.junit_checks(xml)}
    assert rows["test_ok"].status == gc.PASS and rows["test_ok"].seconds == pytest.approx(1.2)
    assert rows["test_two"].status == "needs 2 GPUs"
    assert rows["test_bad"].status == gc.FAIL and rows["test_bad"].detail == "assert 1 == 2"
    assert rows["test_err"].status == gc.FAIL
    assert all(c.key == "pytest" for c in rows.values())


def test_every_row_of_the_report_has_batch_precision_and_tf32():
    checks = [gc.Check("ssgd swb | stacked", gc.PASS, batch="16", precision="bf16", tf32="off",
                       frames_per_s=9212.4, detail="30 steps"),
              gc.Check("pytest tests/gpu", gc.PASS)]
    text = gc.markdown(checks, ["- date: today"], hint="bash scripts/gpu_check.sh r --only x")
    assert "| check | result | s | batch | precision | TF32 | frames/s | detail |" in text
    assert "| ssgd swb / stacked | pass | 0 | 16 | bf16 | off | 9,212 | 30 steps |" in text
    assert "| pytest tests/gpu | pass | 0 | - | - | - | - |  |" in text
    assert "--only x" in text


# ---------------------------------------------------------------------------- steady speed
def test_the_first_window_of_a_run_and_of_its_resume_is_left_out():
    records = [_train(5, 3334.0, 10.0), _train(10, 9000.0, 10.2), _train(15, 9400.0, 10.4),
               {"kind": "resume", "step": 15}, _train(20, 2000.0, 30.0),
               _train(25, 9200.0, 30.2)]
    kept, warmup = steady_records(records)
    assert [r["step"] for r in kept] == [10, 15, 25] and warmup == 2
    speed = steady(records)
    assert speed.frames_per_s == pytest.approx(9200.0)  # the median, not the warm-up's 3,334
    assert speed.sec_per_step == pytest.approx(0.04)
    assert speed.windows == 3 and speed.warmup == 2


def test_a_new_epoch_an_evaluation_or_a_step_going_back_starts_a_segment():
    records = [_train(10, 1.0, 1.0), _train(20, 50.0, 2.0), {"kind": "eval", "step": 20},
               _train(30, 2.0, 5.0, epoch=1), _train(40, 60.0, 6.0, epoch=1),
               _train(45, 3.0, 7.0, epoch=2), _train(10, 4.0, 9.0, epoch=2),
               _train(20, 70.0, 10.0, epoch=2), {"kind": "learners", "step": 20}]
    kept, warmup = steady_records(records)
    assert [r["frames_per_s"] for r in kept] == [50.0, 60.0, 70.0] and warmup == 4
    assert steady(records).frames_per_s == 60.0


def test_a_run_with_only_its_warm_up_window_has_no_steady_speed(tmp_path):
    assert steady([_train(5, 3334.0, 1.0)]) == Steady(None, None, 0, 1)
    assert "no steady window" in steady([_train(5, 3334.0, 1.0)]).describe()
    assert read_steady(tmp_path / "missing.jsonl") is None


def test_read_steady_passes_over_a_half_written_last_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(_train(s, 100.0 * s, float(s))) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"kind": "train", "st')
    speed = read_steady(path)
    assert speed is not None and speed.frames_per_s == 250.0 and speed.windows == 2
    assert "median of 2 steady windows" in speed.describe()


# ---------------------------------------------------------------------------- parts
def test_every_check_is_in_one_part_and_the_default_one_proves_the_gpu(tmp_path):
    items, _ = _plan(tmp_path)
    keys = [item.key for item in items]
    assert len(keys) == len(set(keys)) and {item.part for item in items} == {1, 2, 3}
    assert {item.key for item in _part(items, "1")} == PART_1
    assert {item.key for item in _part(items, "3")} == PART_3
    assert {item.key for item in _part(items, "2")} == set(keys) - PART_1 - PART_3
    assert _part(items, "all") == items
    # Part 1 runs first in --part all; in each part the order is the plan's.
    assert [item.part for item in items] == sorted(item.part for item in items)
    # --only names keys of either part and overrides --part.
    only = {"swbs", "machine"}
    assert {item.key for item in items if gp.chosen(item, "1", only)} == only


def test_the_default_part_runs_every_algorithm_and_the_bf16_lstm(tmp_path):
    items, rec = _plan(tmp_path)
    for item in _part(items, "1"):
        item.run(item.limit)
    trains = [c for c in rec.calls if c[0] == "train"]
    algos = {gc.flag_value(args, "--algo") for _, _, _, args, _, _ in trains}
    assert algos == {"ssgd", "adpsgd", "bmuf"}
    assert any(gc.flag_value(args, "--super-learner-size") == "2" for *_, args, _, _ in trains)
    precisions = {(gc.flag_value(args, "--precision"), preset)
                  for *_, args, _, preset in trains}
    assert ("bf16", "swb") in precisions
    assert ("pytest", 340) in [c[:2] for c in rec.calls]
    assert ("machine",) in rec.calls
    # fp16 (resumed) and bf16 on small run in part 2 (part 1 outgrew its time on 2026-11-28)
    rec.calls.clear()
    for item in _part(items, "2"):
        item.run(item.limit)
    precisions = {(gc.flag_value(args, "--precision"), preset)
                  for c in rec.calls if c[0] == "train" for *_, args, _, preset in [c]}
    assert {("fp16", "small"), ("bf16", "small")} <= precisions
    assert not [c for c in rec.calls if c[0] in ("pytest", "machine")]


def test_the_default_part_fits_its_budget_on_one_h100(tmp_path):
    for gpus in (1, 2, 8):
        items, _ = _plan(tmp_path, gpus)
        for part in ("1", "2", "3"):
            mine = _part(items, part)
            est = gp.estimate(mine, gpus)
            assert est <= gp.DEFAULT_BUDGET_S, (gpus, part, est)
            if gpus == 1:
                assert est <= gp.PART_TARGET_S, (part, est)
            # A hung pytest ends at its limit with the rest of the part still in the budget.
            py = [item for item in mine if item.key == "pytest"]
            if py:
                assert est - py[0].need + py[0].limit <= gp.DEFAULT_BUDGET_S, (gpus, est)
                whole, per_test = gc.pytest_limits(py[0].limit)
                assert py[0].need < whole and per_test < whole
    items, _ = _plan(tmp_path)
    assert gp.estimate(_part(items, "1"), 1) == 420
    assert gp.estimate(items, 1) > gp.DEFAULT_BUDGET_S  # why there are two parts
    # What needs more GPUs than the machine has is not in its estimate.
    assert gp.estimate(_part(items, "2"), 2) - gp.estimate(_part(items, "2"), 1) == 150


def test_a_check_of_the_other_part_is_reported_as_such_and_is_no_failure():
    cmd = gc.part_command("/r/gpu-check-report.md", "2")
    other = gc.not_in_part("train_throughput vs DDP-NCCL", "tt", 2, cmd)
    assert other.status == gc.OTHER_PART == "not in this part" and other.key == "tt"
    checks = [gc.Check("a", gc.PASS), other]
    assert gc.exit_status(checks) == 0 and not gc.failed(other)
    assert "1 in the other part of the plan (not a failure)" in gc.counts_line(checks)
    assert "other part" not in gc.counts_line(checks[:1])
    text = gc.markdown(checks, ["- part: 1 of 2"], other=cmd)
    assert f"| train_throughput vs DDP-NCCL | not in this part | 0 | - | - | - | - | " \
           f"part 2: {cmd} |" in text
    assert f"The other part of the plan: `{cmd}`" in text
    # A check of this part that the budget left out still fails.
    assert gc.exit_status([*checks, gc.Check("b", gc.OVER_BUDGET)]) == 1


def test_each_part_has_its_own_report_and_the_command_of_the_other():
    assert gc.part_report("/r/gpu-check-report.md", "1") == "/r/gpu-check-report.md"
    assert gc.part_report("/r/gpu-check-report.md", "2") == "/r/gpu-check-report-part2.md"
    assert gc.part_report("/r/gpu-check-report-part2.md", "1") == "/r/gpu-check-report.md"
    assert gc.part_report("/r/gpu-check-report-part2.md", "all") == "/r/gpu-check-report-all.md"
    assert gc.part_report("r", "2") == "r-part2"
    assert gc.part_report("/r/gpu-check-report-part2.md", "3") == "/r/gpu-check-report-part3.md"
    assert gc.part_report("/r/gpu-check-report-part3.md", "1") == "/r/gpu-check-report.md"
    assert gc.part_command("/r/a.md", "2") == "bash scripts/gpu_check.sh /r/a-part2.md --part 2"
    assert gc.part_command("/r/a-part2.md", "1") == "bash scripts/gpu_check.sh /r/a.md --part 1"
    # A part-2 report named without its suffix is not overwritten by part 1.
    assert gc.part_command("/r/b.md", "1") == "bash scripts/gpu_check.sh /r/b-part1.md --part 1"


def test_swb_checks_name_the_lstm_layout_they_pass(tmp_path):
    # --lstm-layout auto is stacked on CUDA now: a check must not lean on it for per-layer.
    items, rec = _plan(tmp_path)
    for item in items:
        item.run(100.0)
    swb = {name: args for _, name, _, args, _, preset in
           (c for c in rec.calls if c[0] == "train") if preset == "swb"}
    for name, args in swb.items():
        layout = gc.flag_value(args, "--lstm-layout")
        if "LSTM)" in name:
            assert layout and f"({layout} LSTM)" in name, (name, args)
        else:
            assert layout is None and "layer" not in name and "stacked" not in name, name
    assert gc.flag_value(swb["ssgd swb 1 rank (per-layer LSTM)"], "--lstm-layout") == \
        "per-layer"
    assert gc.flag_value(swb["ssgd swb 1 rank (stacked LSTM)"], "--lstm-layout") == "stacked"
    # The layout pair differs only in the layout (the same batch, precision and TF32).
    strip = [[a for a in args if a not in ("--lstm-layout", "stacked", "per-layer")]
             for args in (swb["ssgd swb 1 rank (per-layer LSTM)"],
                          swb["ssgd swb 1 rank (stacked LSTM)"])]
    assert strip[0] == strip[1]
    # The cuDNN probe builds both layouts explicitly.
    (probe,) = [c for c in rec.calls if c[0] == "python" and "cuDNN" in c[1]]
    assert "stacked and per-layer" in probe[1] and "per_layer=per_layer" in probe[2]


def test_a_run_that_exits_0_with_its_lstm_in_fp32_or_copied_fails():
    """A half-precision run whose LSTM fell back to fp32 measured fp32: it fails, not warns;
    so does one whose cuDNN copies the weights at every forward."""
    fallback = ("[hadpsgd] warning: the LSTM runs in fp32 under torch.bfloat16 autocast on "
                "cuda:0: cuDNN has no bf16 LSTM (the layers after it run in torch.bfloat16)")
    assert "fp32" in gc.bad_output(f"step 10\n{fallback}\nstep 20")
    assert "contiguous" in gc.bad_output("UserWarning: RNN module weights are not part of single "
                                      "contiguous chunk of memory")
    assert gc.bad_output("[hadpsgd] note: MPI is not CUDA-aware\nstep 10 loss 3.1") is None


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("part", ["1", "2", "3"])
def test_the_dry_run_prints_the_plan_and_each_part_fits_one_command(part, gpus):
    """``gpu_check.sh --dry-run`` needs no GPU: it prints every check of the part with its
    estimate and the total, and each part with its set-up fits one 600 s command."""
    import subprocess

    out = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--dry-run", "--part", part,
                          "--gpus", str(gpus)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "set-up" in out.stdout and out.stdout.rstrip().endswith("fits")
    if gpus == 1 and part == "1":
        assert "needs 2 GPUs: not run, no failure" in out.stdout


def test_the_shared_gpu_part_runs_the_nccl_tests_with_the_mode_on(tmp_path):
    """Part 3 (issue 59): on one GPU, tests/gpu's NCCL tests under HADPSGD_SHARE_GPU=1, after
    the versions, the capture beside a pinning thread and the graph probe's overlap in both
    LSTM layouts; no other check sets the mode."""
    items, rec = _plan(tmp_path)
    for item in _part(items, "3"):
        item.run(item.limit)
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["python", "pytest", "bench", "bench", "pytest"]
    _, _, paths, keyword, env = rec.calls[1]
    assert paths == ("tests/gpu/test_gpu_graphs.py",) and keyword == "pinning" and not env
    probes = [c[2] for c in rec.calls[2:4]]
    assert all("benchmarks.training.graph_probe" in cmd for cmd in probes), probes
    assert [cmd[cmd.index("--layout") + 1] for cmd in probes] == ["stacked", "per-layer"]
    _, _, paths, keyword, env = rec.calls[4]
    assert env == {"HADPSGD_SHARE_GPU": "1"} and keyword is None
    assert "tests/gpu/test_gpu_share.py" in paths and "tests/gpu/test_gpu_comm.py" in paths
    rec.calls.clear()
    for item in _part(items, "1") + _part(items, "2"):
        item.run(item.limit)
    assert all(not c[4] for c in rec.calls if c[0] == "pytest")
    for item in _part(items, "3"):  # each on one GPU: a lent machine has one
        assert item.gpus == 1
