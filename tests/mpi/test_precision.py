"""Mixed precision under real mpirun: bf16 for every algorithm (also with oneDNN capped at
AVX2, as on a CPU without native bf16), fp16's agreed loss scale, exact resume with a scale
in the checkpoint, and bf16 gradients on the wire."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest
import torch

from hadpsgd.models import build_model
from tests._mpi import MPIResult, assert_ok, run_mpi, run_worker
from tests.mpi._resume import assert_equal, final_state, kill_then_resume, run_args, train

pytestmark = pytest.mark.mpi

# The layouts: (algorithm flags, ranks). Super-learners are 2 ranks where there are nodes.
LAYOUTS = {
    "ssgd": (["--algo", "ssgd"], 3),
    "bmuf": (["--algo", "bmuf", "--ranks-per-node", "2"], 4),
    "adpsgd": (["--algo", "adpsgd", "--super-learner-size", "1"], 2),
    "hadpsgd": (["--algo", "adpsgd", "--super-learner-size", "2"], 4),
}


def states(res: MPIResult) -> list[dict]:
    """Every rank's end state, as ``tests/workers/precision_run.py`` prints it."""
    assert_ok(res)
    line = next(x for x in res.stdout.splitlines() if x.startswith("STATE "))
    return json.loads(line.removeprefix("STATE "))


def by_node(every: list[dict], key: str) -> dict[int, set]:
    out: dict[int, set] = {}
    for s in every:
        out.setdefault(s["node"], set()).add(s[key])
    return out


def flags(tiny_data, out, *extra: str) -> list[str]:
    return run_args(tiny_data, out, "--batch-size", "4", *extra)[2:]


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def bf16_run(layout: str, tiny_data: tuple[Path, Path], out: Path,
             env: dict[str, str] | None = None) -> MPIResult:
    """12 bf16 steps of ``layout`` through the main command, checked to end well."""
    algo, nprocs = LAYOUTS[layout]
    res = run_mpi(nprocs, run_args(tiny_data, out, *algo, "--batch-size", "4",
                                   "--max-steps", "12", "--precision", "bf16"), env=env)
    assert_ok(res)
    assert json.loads((out / "config.json").read_text())["train"]["precision"] == "bf16"
    evals = [m for m in metrics(out) if m["kind"] == "eval"]
    assert evals and all(math.isfinite(m["heldout_loss"]) for m in evals)
    return res


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_through_the_main_command(layout, tiny_data, tmp_path):
    bf16_run(layout, tiny_data, tmp_path)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="ONEDNN_MAX_CPU_ISA=AVX2 names an x86 ISA")
def test_bf16_on_a_cpu_without_native_bf16(tiny_data: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    """oneDNN capped at AVX2, as on a CPU without AVX-512 (ONEDNN_MAX_CPU_ISA, read by every
    rank): torch's CPU autocast LSTM ended such a run at its first evaluation with oneDNN's
    "could not create a primitive descriptor" (issue 42). The LSTM runs in bf16 there on
    torch's own kernels, with no fallback to fp32 to warn of."""
    res = bf16_run("ssgd", tiny_data, tmp_path, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "primitive descriptor" not in res.output and "runs in fp32" not in res.output


@pytest.mark.parametrize(("layout", "extra"), [("ssgd", []), ("bmuf", []), ("hadpsgd", []),
                                                ("ssgd", ["--grad-wire", "bf16"]),
                                                ("bmuf", ["--grad-wire", "bf16"])])
def test_bf16_replicas_identical_where_promised(layout, extra, tiny_data, tmp_path):
    algo, nprocs = LAYOUTS[layout]
    every = states(run_worker(nprocs, "precision_run",
                              *flags(tiny_data, tmp_path, *algo, "--epochs", "2",
                                     "--precision", "bf16", *extra)))
    assert all(math.isfinite(s["heldout_loss"]) for s in every)
    # Learners that share every step's gradient hold the same bits: the world for SSGD, a
    # super-learner for BMUF and H-ADPSGD; BMUF's global model is the same everywhere.
    assert all(len(d) == 1 for d in by_node(every, "local").values()), every
    if layout == "ssgd":
        assert len({s["local"] for s in every}) == 1, every
    if layout == "bmuf":
        assert len({s["evaluated"] for s in every}) == 1, every
    # bf16 has fp32's range: no loss scale, nothing skipped.
    assert all(s["loss_scale"] == 1.0 and s["skipped_steps"] == 0 for s in every)


@pytest.mark.parametrize("layout", ["ssgd", "bmuf", "hadpsgd"])
def test_fp16_overflow_on_one_learner_is_skipped_by_its_group(layout, tiny_data, tmp_path):
    """Rank 1's fp16 gradient overflows at step 5: every learner that shares its gradient
    skips that step and halves its scale (2**16 -> 2**15); other super-learners do not."""
    algo, nprocs = LAYOUTS[layout]
    every = states(run_worker(nprocs, "precision_run",
                              *flags(tiny_data, tmp_path, *algo, "--max-steps", "12",
                                     "--precision", "fp16", "--max-nonfinite", "0"),
                              env={"HADPSGD_FAULT": "kind=overflow,rank=1,step=5"}))
    group = {s["node"] for s in every if s["rank"] == 1} if layout != "ssgd" else None
    for s in every:
        hit = group is None or s["node"] in group
        assert s["loss_scale"] == (2.0**15 if hit else 2.0**16), every
        assert s["overflow_steps"] == s["skipped_steps"] == (1 if hit else 0), every
        assert s["nonfinite"] == 0, every  # the scale's search is no non-finite data
    assert all(len(d) == 1 for d in by_node(every, "local").values()), every
    if layout == "ssgd":
        assert len({s["local"] for s in every}) == 1, every


def test_fp16_run_finding_its_scale_is_not_stopped(tiny_data, tmp_path):
    """Overflows on 3 steps with --max-nonfinite 0 through the main command: the run ends
    normally, and the log counts the overflows apart (3), with the scale halved 3 times."""
    res = run_mpi(2, run_args(tiny_data, tmp_path, "--batch-size", "4", "--max-steps", "12",
                              "--log-every", "4", "--precision", "fp16", "--max-nonfinite",
                              "0"),
                  env={"HADPSGD_FAULT": "kind=overflow,rank=1,step=3,count=3"})
    assert_ok(res)
    last = [m for m in metrics(tmp_path) if m["kind"] == "train"][-1]
    assert last["overflow_steps"] == 3 and last["loss_scale"] == 2.0**13, last
    assert last["skipped_steps"] == 3


@pytest.mark.parametrize("algo", [["--algo", "ssgd"],
                                  ["--algo", "bmuf", "--ranks-per-node", "1"]])
def test_fp16_resume_is_exact_with_the_scale(algo, tiny_data, tmp_path):
    """Killed after a checkpoint and resumed, an fp16 run ends bit-identical to one that was
    never stopped, loss scales included (BMUF: each super-learner's own)."""
    common = [*algo, "--batch-size", "4", "--max-steps", "16", "--checkpoint-every", "6",
              "--precision", "fp16"]
    overflow = "kind=overflow,rank=1,step=3"
    ref = tmp_path / "ref"
    train(2, tiny_data, ref, *common, env={"HADPSGD_FAULT": overflow})
    out = tmp_path / "resumed"
    # The resumed run starts after step 6: the overflow at step 3 is in its checkpoint.
    kill_then_resume(2, tiny_data, out, *common, fault=f"{overflow};kind=kill,rank=1,step=9")
    a, b = final_state(ref), final_state(out)
    if "bmuf" in algo:  # rank 1 is super-learner 1: its scale alone was halved
        scales = [n["loss_scale"]["scale"] for n in a["node_states"]]
        assert scales == [2.0**16, 2.0**15], scales
    else:
        assert a["algo"]["loss_scale"]["scale"] == 2.0**15
    for key in ("model", "algo", "node_states", "eval_model"):
        assert_equal(a.get(key), b.get(key), key)


def test_grad_wire_bf16_is_within_tolerance_of_fp32_at_half_the_bytes(tiny_data, tmp_path):
    """SSGD with bf16 gradient buckets on the wire after 20 steps: the update (weights minus
    the initial weights) is within 1 % (relative L2) of fp32 SSGD's (measured: 0.12 %), and
    the bytes sent are half (up to shard padding)."""
    every = {}
    for wire in ("fp32", "bf16"):
        every[wire] = states(run_worker(3, "precision_run",
                                        *flags(tiny_data, tmp_path / wire, "--max-steps", "20",
                                               "--grad-wire", wire)))
    a = final_state(tmp_path / "fp32")["model"]
    b = final_state(tmp_path / "bf16")["model"]
    # The updates, not the weights: against the initial weights (rank 0's, from the seed)
    # a wrong mean (a sum, a lost bucket) would hide in a small relative weight change.
    torch.manual_seed(0)
    init = build_model("tiny", 260, 12).state_dict()
    diff = math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a))
    moved = math.sqrt(sum(float((a[k].double() - init[k].double()).pow(2).sum()) for k in a))
    print(f"grad wire bf16 vs fp32 after 20 steps: update differs by {diff / moved:.4f}")
    assert 0 < diff / moved < 0.01, diff / moved
    full = every["fp32"][0]["grad_wire_bytes"]
    half = every["bf16"][0]["grad_wire_bytes"]
    assert full > 0 and 0.5 <= half / full < 0.51, (half, full)


@pytest.mark.parametrize(("scope", "nprocs", "per_node"), [("world", 3, None),
                                                            ("node", 4, 2),
                                                            ("world", 4, 2)])
def test_half_mean_against_a_float64_reference(scope, nprocs, per_node):
    env = {"HADPSGD_RANKS_PER_NODE": str(per_node)} if per_node else {}
    res = run_worker(nprocs, "half_mean", scope, env=env)
    assert_ok(res)
    assert res.stdout.count("OK rank") == nprocs
